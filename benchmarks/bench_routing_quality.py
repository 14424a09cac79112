"""Routing quality on real engines: round robin vs load-only vs precise prefix + load.

Issue 4's last benchmark. ``--engines`` (2) real ``kvserve serve`` processes of the tiny
preset (``--num-threads 1`` each, ``--num-kv-blocks`` sized per workload so its working set
exceeds one engine's pool but fits the cluster: ``--pool-fraction`` 0.6 of it per engine,
so one engine cannot hold all four shared system prompts of the second workload)
behind ``kvserve route`` (``LocalCluster``), driven by the closed-loop load generator of
``kvserve.bench`` with two prefill-heavy workloads (long prompts, short answers: the regime
where KV-aware routing matters, e.g. agents re-reading a code base, RAG, long chats):

- ``multi-turn``: chat sessions whose history grows turn by turn (token-id prompts);
- ``system-prompt``: a few long system prompts shared by many single-turn users.

Every strategy runs ``--reps`` times (a fresh cluster each, strategies interleaved); the
tables give medians.

Router configurations (one freshly started cluster per run, the same seeded workload):

- ``round-robin``: ``--picker round_robin`` (scores ignored);
- ``load``: ``--scorer load=1`` (least active requests);
- ``prefix+load``: ``--scorer precise_prefix=3 --scorer load=1`` (KV-event index);
- ``prefix+load2+queue+kv``: the router's defaults before this benchmark (precise prefix 3,
  load 2, queue depth 1, KV utilization 1);
- ``default``: the router's defaults (``cluster/config.py``: precise prefix 3 with
  speculative entries + load 1, plus approximate prefix 3 for endpoints without KV events).

Reported per run: TTFT p50/p90, output and total token throughput, the share of prompt
tokens served from the engines' prefix caches. Results go to
``benchmarks/results/routing_quality.{md,json,png}``.

    .venv/bin/python benchmarks/bench_routing_quality.py            # ~4 minutes on 2 cores
    .venv/bin/python benchmarks/bench_routing_quality.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from kvserve.bench.cli import default_model_dir, tokenizer_for
from kvserve.bench.local_cluster import ClusterSpec, LocalCluster
from kvserve.bench.machine import describe_machine, machine_markdown
from kvserve.bench.report import Summary
from kvserve.bench.workloads import Workload, multi_turn_workload, system_prompt_workload

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16

STRATEGIES: dict[str, list[str]] = {
    "round-robin": ["--picker", "round_robin"],
    "load": ["--scorer", "load=1"],
    "prefix+load": ["--scorer", "precise_prefix=3", "--scorer", "load=1"],
    # The router's defaults before this benchmark chose new ones (approx_prefix 3 as well,
    # inert here: it only scores endpoints without KV events).
    "prefix+load2+queue+kv": [
        *("--scorer", "precise_prefix=3", "--scorer", "load=2"),
        *("--scorer", "queue_depth=1", "--scorer", "kv_cache_util=1"),
    ],
    "default": [],
}
BASELINE = "round-robin"


def workloads(args: argparse.Namespace, vocab) -> list[Workload]:
    scale = 0.5 if args.quick else 1.0
    return [
        multi_turn_workload(
            num_sessions=max(4, int(10 * scale)),
            num_turns=4,
            first_len=1536,
            user_len=64,
            output_len=args.output_len,
            think_time=0.05,
            vocab=vocab,
            seed=args.seed,
        ),
        system_prompt_workload(
            num_system_prompts=4,
            num_users=max(8, int(48 * scale)),
            system_prompt_len=1536,
            question_len=48,
            output_len=args.output_len,
            vocab=vocab,
            seed=args.seed,
        ),
    ]


def working_set_blocks(w: Workload) -> int:
    """Distinct full blocks of prompt + output the workload's sessions produce (approx.)."""
    prefixes = {tuple(s.prefix) for s in w.sessions if s.prefix}
    blocks = sum(len(p) // BLOCK_SIZE for p in prefixes)
    for s in w.sessions:
        n = sum(len(t.user) + t.output_len for t in s.turns)
        blocks += n // BLOCK_SIZE
    return blocks


def run_one(
    args, model_dir: Path, w: Workload, label: str, router_args: list[str], tokenize, pool: int
):
    spec = ClusterSpec(
        model_dir=str(model_dir),
        num_engines=args.engines,
        engine_args=[
            *("--num-kv-blocks", str(pool), "--max-num-seqs", "8"),
            *("--num-threads", "1"),
        ],
        router_args=router_args,
    )
    t0 = time.monotonic()
    with LocalCluster(spec) as cluster:
        print(f"== {w.name} / {label}: up in {time.monotonic() - t0:.1f}s", flush=True)
        run = cluster.run_workload(
            w,
            concurrency=args.concurrency,
            label=label,
            seed=args.seed,
            tokenize=tokenize,
            progress=False,
        )
    s = run.summary
    print(
        f"   TTFT p50 {s.ttft.p50 * 1e3:.0f} ms p90 {s.ttft.p90 * 1e3:.0f} ms, "
        f"{s.output_throughput:.1f} out tok/s, cache hit {s.cache_hit_ratio or 0:.0%}, "
        f"failed {s.failed}, by endpoint {s.endpoints}",
        flush=True,
    )
    return run


def median_row(runs: list[Summary]) -> dict:
    """One strategy's runs: medians of the measurements, the runs' counts summed."""
    med = statistics.median
    endpoints: dict[str, int] = {}
    for s in runs:
        for k, v in s.endpoints.items():
            endpoints[k] = endpoints.get(k, 0) + v
    return {
        "strategy": runs[0].label,
        "runs": len(runs),
        "requests": sum(s.num_requests for s in runs),
        "failed": sum(s.failed for s in runs),
        "ttft_p50_ms": med(s.ttft.p50 * 1e3 for s in runs if s.ttft),
        "ttft_p90_ms": med(s.ttft.p90 * 1e3 for s in runs if s.ttft),
        "ttft_p90_ms_runs": [round(s.ttft.p90 * 1e3, 1) for s in runs if s.ttft],
        "output_tok_s": med(s.output_throughput for s in runs),
        "total_tok_s": med(s.total_token_throughput for s in runs),
        "total_tok_s_runs": [round(s.total_token_throughput) for s in runs],
        "cache_hit_ratio": med((s.cache_hit_ratio or 0.0) for s in runs),
        "duration_s": med(s.duration for s in runs),
        "endpoints": endpoints,
    }


def with_gains(r: dict, base: dict | None) -> dict:
    r["ttft_p90_vs_baseline"] = base["ttft_p90_ms"] / r["ttft_p90_ms"] if base else None
    r["throughput_vs_baseline"] = r["total_tok_s"] / base["total_tok_s"] if base else None
    return r


def table(rows: list[dict]) -> str:
    out = [
        "| strategy | TTFT p50 ms | TTFT p90 ms | out tok/s | total tok/s | cache hit | "
        "TTFT p90 gain | throughput gain | failed | requests per engine |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        eps = ", ".join(f"{k}: {v}" for k, v in sorted(r["endpoints"].items()))
        out.append(
            f"| {r['strategy']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
            f"{r['output_tok_s']:.1f} | {r['total_tok_s']:.0f} | "
            f"{(r['cache_hit_ratio'] or 0):.0%} | {r['ttft_p90_vs_baseline']:.2f}x | "
            f"{r['throughput_vs_baseline']:.2f}x | {r['failed']} | {eps} |"
        )
    return "\n".join(out)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.6 * len(results)), squeeze=False)
    for i, (wname, rows) in enumerate(results.items()):
        names = [r["strategy"] for r in rows]
        x = range(len(rows))
        ax = axes[i][0]
        ax.bar([j - 0.2 for j in x], [r["ttft_p50_ms"] for r in rows], 0.4, label="p50")
        ax.bar([j + 0.2 for j in x], [r["ttft_p90_ms"] for r in rows], 0.4, label="p90")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{wname}: time to first token (lower is better)")
        ax.legend()
        ax = axes[i][1]
        ax.bar(list(x), [r["total_tok_s"] for r in rows], 0.6, color="tab:green")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("prompt + output tokens / s")
        ax.set_title(f"{wname}: throughput (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument(
        "--pool-fraction",
        type=float,
        default=0.6,
        help="primary pool per engine, as a fraction of the workload's working set",
    )
    ap.add_argument("--reps", type=int, default=2, help="runs per strategy (medians reported)")
    ap.add_argument("--concurrency", type=int, default=4, help="sessions in flight")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument(
        "--strategies",
        nargs="+",
        default=["round-robin", "load", "prefix+load", "default"],
        choices=list(STRATEGIES),
    )
    ap.add_argument("--workloads", nargs="+", default=["multi-turn", "system-prompt"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="half-size workloads (smoke run)")
    ap.add_argument("--out", default=str(RESULTS / "routing_quality"))
    args = ap.parse_args()

    model_dir = default_model_dir("tiny")
    vocab, tokenize = tokenizer_for(model_dir)
    started = time.monotonic()
    results: dict[str, list[dict]] = {}
    sizes: dict[str, dict] = {}
    for w in workloads(args, vocab):
        if w.name not in args.workloads:
            continue
        ws = working_set_blocks(w)
        pool = max(64, int(args.pool_fraction * ws))
        sizes[w.name] = {"working_set_blocks": ws, "pool_blocks": pool, "params": w.params}
        print(
            f"# {w.name}: {len(w.sessions)} sessions, working set ~{ws} blocks "
            f"(one engine holds {pool}, the cluster {args.engines * pool})",
            flush=True,
        )
        by_label: dict[str, list[Summary]] = {label: [] for label in args.strategies}
        for _ in range(args.reps):
            for label in args.strategies:
                run = run_one(args, model_dir, w, label, STRATEGIES[label], tokenize, pool)
                by_label[label].append(run.summary)
        rows = {label: median_row(sums) for label, sums in by_label.items()}
        base = rows.get(BASELINE)
        results[w.name] = [with_gains(r, base) for r in rows.values()]
    elapsed = time.monotonic() - started

    machine = describe_machine()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "routing_quality",
        "machine": machine,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "elapsed_s": elapsed,
        "config": {
            "engines": args.engines,
            "pool_fraction": args.pool_fraction,
            "reps": args.reps,
            "block_size": BLOCK_SIZE,
            "concurrency": args.concurrency,
            "output_len": args.output_len,
            "engine_args": ["--num-threads", "1", "--max-num-seqs", "8"],
            "strategies": {k: STRATEGIES[k] for k in args.strategies},
            "quick": args.quick,
        },
        "workloads": sizes,
        "results": results,
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    sections = []
    for wname, rows in results.items():
        ws = sizes[wname]["working_set_blocks"]
        sections.append(
            f"### {wname}\n\nParameters: `{json.dumps(sizes[wname]['params'])}`; working set "
            f"~{ws} blocks, {sizes[wname]['pool_blocks']} per engine.\n\n{table(rows)}\n"
        )
    md = f"""# Routing quality on real engines

`.venv/bin/python benchmarks/bench_routing_quality.py{" --quick" if args.quick else ""}`
({time.strftime("%Y-%m-%d")}, {elapsed / 60:.1f} min). {args.engines} `kvserve serve` engines
(tiny preset, `--num-threads 1`, `--max-num-seqs 8`, a primary pool of
{args.pool_fraction:.0%} of the workload's working set each, blocks of {BLOCK_SIZE} tokens)
behind `kvserve route`; a fresh cluster per run, {args.reps} runs per strategy (interleaved;
medians shown, per-run values in the JSON); closed loop, {args.concurrency} sessions in flight,
{args.output_len} output tokens per request, token-id prompts. Gains are relative to round
robin (TTFT p90: baseline / run; throughput: run / baseline). "cache hit": prompt tokens the
engines served from their prefix caches.

Strategies: {
        ", ".join(
            f"`{k}` ({' '.join(v) or 'router defaults'})"
            for k, v in STRATEGIES.items()
            if k in args.strategies
        )
    }.

## Machine
{machine_markdown(machine)}
- Load average (1 min) at the end: {os.getloadavg()[0]:.2f} (2 cores shared with other work)

## Results

{chr(10).join(sections)}
![routing quality](routing_quality.png)
"""
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
