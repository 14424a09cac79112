"""Cluster-scale routing: simulated H100 instances (16 by default) behind `kvserve route`.

llm-d's published experiment, scaled down (anchors.md: 16 H100, 150 groups x 6k-token
prefixes needing 73% of the cluster's KV; precise routing 8,730 tok/s and TTFT p90 0.54 s,
approximate 6,944 tok/s / 31 s, random 4,429 tok/s / 92.6 s). Here: 16 ``kvserve sim``
instances (latency model ``h100-llama8b``: Llama-3.1-8B on H100; real block pool, prefix
cache, scheduler, KV events, HTTP server) in one process, the real router in another, and the
open-loop load generator of ``kvserve.bench`` in this one. G groups x 6k-token prefixes, many
users per group, pools sized so the prefixes need ``--fraction`` (70%) of the cluster's KV.

One run per strategy, each on a freshly started cluster:

- ``random``, ``round-robin``: pickers that ignore scores;
- ``load``: least active requests (scraped running + waiting, router in-flight);
- ``approx-prefix``: the router's own routing history (no KV events) + load;
- ``precise-prefix``: the router's default config (KV-event index, tier-weighted prefix 3,
  load 2, queue 1, KV utilization 1);
- ``precise-tiers``: the same router on instances with a host-memory offload tier (CPU
  medium events, tier weights GPU 1.0 / CPU 0.8);
- ``oracle``: the same gateway with a scorer that reads every engine's exact cache, free
  queue and queues in the simulator's process and picks the minimum of predicted TTFT plus
  the prefill of the cached blocks the placement would evict (upper bound; see
  ``kvserve/sim/oracle.py``).

Simulated time runs ``--time-scale`` times slower than the modelled hardware (room for 16
instances on 2 cores); every latency and throughput reported is converted back to modelled
seconds. Goals (issue 5): precise prefix TTFT p90 >= 50x better and throughput >= 1.9x
random, >= 95% of the oracle's throughput.

    .venv/bin/python benchmarks/bench_cluster_routing.py            # ~8 minutes
    .venv/bin/python benchmarks/bench_cluster_routing.py --quick    # smaller smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from kvserve.bench.loadgen import LoadConfig, run_load, wait_for_server
from kvserve.bench.machine import describe_machine
from kvserve.bench.records import RequestRecord
from kvserve.bench.report import Run, Summary, summarize, write_report
from kvserve.bench.workloads import Session, Turn, Vocab, Workload, prefix_groups_workload
from kvserve.sim.instance import default_model_dir
from kvserve.sim.latency_model import get_preset

RESULTS = Path(__file__).resolve().parent / "results"
STRATEGIES = (
    "random",
    "round-robin",
    "load",
    "approx-prefix",
    "precise-prefix",
    "precise-tiers",
    "oracle",
)
PY = sys.executable
# Routers that ignore prefixes overload the cluster: most of their run is long prefill steps
# (little host CPU per wall second), so they run at a faster time scale to fit the budget.
BLIND = ("random", "round-robin", "load")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Router configurations


def router_config(strategy: str, endpoints: list[dict], tokenizer: str, port: int) -> dict:
    eps = [dict(e) for e in endpoints]
    scheduler: dict = {}
    if strategy == "random":
        scheduler = {"scorers": [], "picker": {"name": "random", "params": {"seed": 0}}}
    elif strategy == "round-robin":
        scheduler = {"scorers": [], "picker": {"name": "round_robin"}}
    elif strategy == "load":
        scheduler = {"scorers": [{"name": "load", "weight": 1.0, "params": {"capacity": 32}}]}
    elif strategy == "approx-prefix":
        for e in eps:  # the router learns only from its own routing decisions
            e.pop("kv_events", None)
            e.pop("kv_events_replay", None)
        scheduler = {
            "scorers": [
                {"name": "approx_prefix", "weight": 3.0},
                {"name": "load", "weight": 2.0, "params": {"capacity": 32}},
                {"name": "queue_depth", "weight": 1.0},
                {"name": "kv_cache_util", "weight": 1.0},
            ]
        }
    elif strategy in ("precise-prefix", "precise-tiers"):
        scheduler = {}  # the router's defaults (see kvserve/cluster/config.py)
    else:
        raise ValueError(strategy)
    cfg: dict = {
        "host": "127.0.0.1",
        "port": port,
        "endpoints": eps,
        "tokenizer": tokenizer,
        "log_level": "warning",
        # The simulator's 16 servers share one process: be patient with slow health answers.
        # Scrapes of 16 servers' /metrics cost the simulator CPU: once a second.
        "health": {"timeout_s": 10.0, "unhealthy_after": 5, "metrics_interval_s": 1.0},
    }
    if scheduler:
        cfg["scheduler"] = scheduler
    return cfg


# ---------------------------------------------------------------------------------------------
# Processes


class Procs:
    """Child processes, each in its own process group; all stopped on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the proc
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        p = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.procs.append((name, p))
        return p

    def stop_all(self, timeout: float = 20.0) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        deadline = time.monotonic() + timeout
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []


def time_scale(strategy: str, args) -> float:
    return args.blind_time_scale if strategy in BLIND else args.time_scale


def start_sims(
    procs: Procs, args, scale: float, num_blocks: int, offload_gib: float, oracle: bool
) -> dict:
    eps_file = procs.log_dir / "endpoints.yaml"
    eps_file.unlink(missing_ok=True)
    argv = [
        PY,
        "-m",
        "kvserve.cli",
        "sim",
        "--num-instances",
        str(args.num_instances),
        "--base-port",
        "0",
        "--kv-events-base-port",
        "0",
        "--preset",
        args.preset,
        "--time-scale",
        str(scale),
        "--num-kv-blocks",
        str(num_blocks),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--model",
        args.model_dir,
        "--write-endpoints",
        str(eps_file),
        # Replay sockets poll every 5 ms per instance: CPU this 2-core host lacks.
        "--no-kv-events-replay",
    ]
    if offload_gib > 0:
        argv += ["--kv-offload-size", str(offload_gib)]
    if oracle:
        argv += ["--oracle-port", "0"]
    p = procs.start("sim", argv)
    deadline = time.monotonic() + 180
    while not eps_file.exists():
        if p.poll() is not None:
            raise RuntimeError(f"kvserve sim exited ({p.returncode}); see {procs.log_dir}")
        if time.monotonic() > deadline:
            raise TimeoutError("kvserve sim did not start")
        time.sleep(0.2)
    return yaml.safe_load(eps_file.read_text())


def start_router(procs: Procs, strategy: str, sims: dict, args) -> str:
    port = free_port()
    cfg = router_config(strategy, sims["endpoints"], args.model_dir, port)
    path = procs.log_dir / f"router-{strategy}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    p = procs.start(f"router-{strategy}", [PY, "-m", "kvserve.cli", "route", "--config", str(path)])
    url = f"http://127.0.0.1:{port}"
    wait_for_server(url, timeout=60, proc=p)
    wait_healthy(url, len(sims["endpoints"]))
    return url


def wait_healthy(url: str, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5, trust_env=False) as c:
        while time.monotonic() < deadline:
            try:
                r = c.get(url + "/health")
                if r.status_code == 200 and r.json().get("healthy_endpoints", n) >= n:
                    time.sleep(1.0)  # KV event subscriptions connect (ZMQ slow joiner)
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
    raise TimeoutError(f"router at {url}: fewer than {n} healthy endpoints")


def scrape_instances(endpoints: list[dict]) -> dict:
    """Sum of the instances' prefix-cache and offload counters (/metrics)."""
    from kvserve.cluster.endpoints import parse_prometheus_text

    names = (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_sum",
        "vllm:time_to_first_token_seconds_count",
    )
    total = dict.fromkeys(names, 0.0)
    busy_wall = busy_modelled = 0.0
    with httpx.Client(timeout=10, trust_env=False) as c:
        for e in endpoints:
            try:
                vals = parse_prometheus_text(c.get(e["url"] + "/metrics").text, names)
                sim = c.get(e["url"] + "/sim/stats").json()
            except (httpx.HTTPError, ValueError):
                continue
            for k in names:
                total[k] += vals.get(k, 0.0)
            busy_wall += sim["busy_wall_s"]
            busy_modelled += sim["busy_modelled_s"]
    # Wall time of busy engine steps over their modelled time: 1.0 = the host kept the pace.
    total["sim_pace"] = busy_wall / busy_modelled if busy_modelled else float("nan")
    n = total["vllm:time_to_first_token_seconds_count"]
    # Mean TTFT as the engines saw it (wall seconds, arrival in the engine to first token).
    total["engine_ttft_mean_wall_s"] = total["vllm:time_to_first_token_seconds_sum"] / n if n else 0
    return total


# ---------------------------------------------------------------------------------------------
# Modelled time


def to_modelled(records: list[RequestRecord], scale: float) -> list[RequestRecord]:
    out = []
    for r in records:
        m = dataclasses.replace(r, itl=[x / scale for x in r.itl])
        m.start_time = r.start_time / scale
        m.ttft = None if r.ttft is None else r.ttft / scale
        m.e2e = None if r.e2e is None else r.e2e / scale
        out.append(m)
    return out


# ---------------------------------------------------------------------------------------------


def size_cluster(args) -> tuple[int, int]:
    """(num_kv_blocks per instance incl. the null block, prefix blocks of all groups)."""
    bs = 16
    prefix_blocks = args.num_groups * math.ceil(args.prefix_len / bs)
    per_instance = math.ceil(prefix_blocks / (args.fraction * args.num_instances))
    return per_instance + 1, prefix_blocks


def warmup_workload(workload: Workload, vocab: Vocab, question_len: int, seed: int) -> Workload:
    """One request per group (its prefix + a fresh question), sent all at once before the
    measured run: every prefix is computed once somewhere, as after llm-d's low-rate stages."""
    import random

    rng = random.Random(f"warmup:{seed}")
    prefixes: dict[int, list[int]] = {}
    for s in workload.sessions:
        if s.group is not None and s.group not in prefixes:
            prefixes[s.group] = list(s.prefix)  # type: ignore[arg-type]
    sessions = [
        Session(f"w{g}", [Turn(vocab.sample(rng, question_len), 1)], prefix=p, group=g)
        for g, p in sorted(prefixes.items())
    ]
    return Workload("prefix-groups-warmup", sessions, workload.kind)


def run_strategy(strategy: str, args, workload, warmup, num_blocks: int, log_root: Path) -> Run:
    log_dir = log_root / strategy
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = Procs(log_dir)
    offload = args.offload_gib if strategy == "precise-tiers" else 0.0
    scale = time_scale(strategy, args)
    try:
        sims = start_sims(procs, args, scale, num_blocks, offload, oracle=strategy == "oracle")
        if strategy == "oracle":
            url = sims["oracle"]
            wait_healthy(url, len(sims["endpoints"]))
        else:
            url = start_router(procs, strategy, sims, args)
        model = sims["endpoints"][0]["model"]
        cfg = LoadConfig(
            base_url=url,
            model=model,
            request_rate=args.rate / scale,
            seed=args.seed,
            progress=not args.no_progress,
            label=strategy,
            timeout=3600,
        )
        t0 = time.monotonic()
        result = run_load(workload, cfg, warmup=warmup)
        wall = time.monotonic() - t0
        counters = scrape_instances(sims["endpoints"])
    finally:
        procs.stop_all()
    records = to_modelled(result.records, scale)
    summary = summarize(records, result.duration / scale, strategy)
    conf = {
        "strategy": strategy,
        "time_scale": scale,
        "offload_gib_per_instance": offload,
        "request_rate_modelled": args.rate,
        "wall_seconds": round(wall, 1),
        "instance_counters": counters,
    }
    return Run(summary, records, conf)


def goals(by: dict[str, Summary]) -> tuple[str, dict]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return None if not a or not b else a / b

    rnd, pre, ora = by.get("random"), by.get("precise-prefix"), by.get("oracle")
    res: dict = {}
    if rnd and pre and rnd.ttft and pre.ttft:
        res["ttft_p90_vs_random"] = ratio(rnd.ttft.p90, pre.ttft.p90)
        res["throughput_vs_random"] = ratio(pre.output_throughput, rnd.output_throughput)
    if ora and pre:
        res["throughput_vs_oracle"] = ratio(pre.output_throughput, ora.output_throughput)
    want = {"ttft_p90_vs_random": 50.0, "throughput_vs_random": 1.9, "throughput_vs_oracle": 0.95}
    lines = ["| goal (precise prefix) | target | measured | met |", "|---|---|---|---|"]
    names = {
        "ttft_p90_vs_random": "TTFT p90, random / precise",
        "throughput_vs_random": "output throughput, precise / random",
        "throughput_vs_oracle": "output throughput, precise / oracle",
    }
    for k, target in want.items():
        v = res.get(k)
        shown = "n/a" if v is None else f"{v:.2f}x" if k != "throughput_vs_oracle" else f"{v:.1%}"
        tgt = f">= {target:g}x" if k != "throughput_vs_oracle" else f">= {target:.0%}"
        met = "n/a" if v is None else ("yes" if v >= target else "**no**")
        lines.append(f"| {names[k]} | {tgt} | {shown} | {met} |")
    return "\n".join(lines) + "\n", res


def strategy_table(runs: list[Run]) -> str:
    base = next((r.summary for r in runs if r.summary.label == "random"), None)
    lines = [
        "| strategy | output tok/s | total tok/s | TTFT p50 (s) | TTFT p90 (s) | "
        "cache hit | completed | time scale | pace | vs random: tput / TTFT p90 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r.summary
        p50 = s.ttft.p50 if s.ttft else float("nan")
        p90 = s.ttft.p90 if s.ttft else float("nan")
        hit = "n/a" if s.cache_hit_ratio is None else f"{s.cache_hit_ratio:.1%}"
        vs = ""
        if base is not None and base.ttft and s.ttft:
            vs = f"{s.output_throughput / base.output_throughput:.2f}x / "
            vs += f"{base.ttft.p90 / s.ttft.p90:.1f}x"
        lines.append(
            f"| {s.label} | {s.output_throughput:.0f} | {s.total_token_throughput:.0f} | "
            f"{p50:.3f} | {p90:.3f} | {hit} | {s.completed}/{s.num_requests} | "
            f"{r.config['time_scale']:g} | {r.config['instance_counters']['sim_pace']:.2f} | {vs} |"
        )
    return "\n".join(lines) + "\n"


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt  # unwinds through every `finally`: child processes are stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-instances", type=int, default=16)
    ap.add_argument("--preset", default="h100-llama8b")
    ap.add_argument("--time-scale", type=float, default=12.0, help="wall s per modelled s")
    ap.add_argument(
        "--blind-time-scale",
        type=float,
        default=4.0,
        help="time scale of the prefix-blind routers (random, round-robin, load)",
    )
    ap.add_argument("--num-groups", type=int, default=32)
    ap.add_argument("--users-per-group", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=6144)
    ap.add_argument("--question-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--fraction", type=float, default=0.7, help="prefixes / cluster KV")
    ap.add_argument("--rate", type=float, default=80.0, help="modelled requests per second")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--offload-gib",
        type=float,
        default=0.0,
        help="host tier per instance in precise-tiers (default: 2x the pool)",
    )
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", help="tokenizer directory (default: the cached tiny preset)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--stem", default="cluster_routing")
    ap.add_argument("--quick", action="store_true", help="a smaller, shorter run")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_instances, args.num_groups, args.users_per_group = 4, 8, 12
        args.rate = args.rate / 4
    args.model_dir = str(args.model_dir or default_model_dir())
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in strategies:
        if s not in STRATEGIES:
            ap.error(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")

    latency = get_preset(args.preset)
    num_blocks, prefix_blocks = size_cluster(args)
    block_bytes = latency.block_bytes(16)
    if args.offload_gib <= 0:
        args.offload_gib = round(2 * num_blocks * block_bytes / (1 << 30), 3)
    vocab = Vocab.from_model_dir(args.model_dir)
    workload = prefix_groups_workload(
        args.num_groups,
        args.users_per_group,
        prefix_len=args.prefix_len,
        question_len=args.question_len,
        output_len=args.output_len,
        vocab=vocab,
        seed=args.seed,
    )
    warmup = warmup_workload(workload, vocab, args.question_len, args.seed)
    setup = (
        f"{args.num_instances} x `kvserve sim --preset {args.preset}` ({num_blocks - 1} usable "
        f"KV blocks of 16 tokens each = {(num_blocks - 1) * 16} tokens, "
        f"{(num_blocks - 1) * block_bytes / 2**30:.1f} GiB modelled), "
        f"{args.num_groups} groups x {args.prefix_len}-token prefixes = "
        f"{prefix_blocks / ((num_blocks - 1) * args.num_instances):.0%} of the cluster's KV; "
        f"{args.users_per_group} users per group, one {args.question_len}-token question each, "
        f"{args.output_len} output tokens; Poisson arrivals at {args.rate:g} req/s (modelled); "
        f"before each measured run, one request per group is sent at once (warm-up, not "
        f"measured); time scale {args.time_scale:g} ({args.blind_time_scale:g} for "
        f"{', '.join(BLIND)}, whose runs are mostly long prefill steps; the `pace` column "
        f"shows each run kept the modelled pace); max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}; precise-tiers adds a "
        f"{args.offload_gib:g} GiB host tier per instance"
    )
    print(setup, flush=True)
    runs: list[Run] = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvserve-cluster-routing-") as tmp:
        for strategy in strategies:
            t0 = time.monotonic()
            run = run_strategy(strategy, args, workload, warmup, num_blocks, Path(tmp))
            s = run.summary
            counters = run.config["instance_counters"]
            print(
                f"{strategy:>15}: {s.output_throughput:8.0f} out tok/s  TTFT p50 "
                f"{s.ttft.p50 if s.ttft else float('nan'):.3f}s p90 "
                f"{s.ttft.p90 if s.ttft else float('nan'):.3f}s  hit "
                f"{(s.cache_hit_ratio or 0):.1%}  failed {s.failed}  "
                f"pace {counters['sim_pace']:.2f}  engine TTFT mean "
                f"{counters['engine_ttft_mean_wall_s'] / run.config['time_scale']:.3f}s  "
                f"({time.monotonic() - t0:.0f}s wall)",
                flush=True,
            )
            runs.append(run)
    by = {r.summary.label: r.summary for r in runs}
    goal_md, goal_vals = goals(by)
    notes = (
        "## Setup\n\n" + setup + ".\n\n"
        "All latencies and throughputs are in modelled seconds (wall / time scale). "
        "Instances are the real engine (block pool, prefix cache, scheduler, KV events, "
        "OpenAI server) with the latency model of `kvserve/sim/latency_model.py`; the "
        "router is `kvserve route` in its own process (the oracle: the same gateway inside "
        "the simulator's process, reading every engine's exact state).\n\n"
        "## Strategies\n\n" + strategy_table(runs) + "\n## Goals\n\n" + goal_md + "\n"
        f"Total wall time: {time.monotonic() - t_start:.0f} s.\n"
    )
    machine = describe_machine()
    paths = write_report(
        args.out,
        runs,
        title=f"Cluster routing: prefix groups on {args.num_instances} simulated instances",
        machine=machine,
        workload=workload.describe(),
        baseline="random" if "random" in by else None,
        notes=notes,
        stem=args.stem,
    )
    doc = json.loads(paths["json"].read_text())
    doc["goals"] = goal_vals
    doc["setup"] = setup
    doc["args"] = vars(args)
    paths["json"].write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print("\n" + strategy_table(runs) + "\n" + goal_md)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
