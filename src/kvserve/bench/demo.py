"""The README demo: KV-aware routing + KV offloading vs round robin without, on real engines.

Creates the tiny model if missing, starts a local cluster (router + 2 engines, small primary
KV pools so the chat history outgrows them; in the KV-aware phase a host tier per engine and
one file-system tier both engines share), replays one seeded multi-turn chat workload twice
and prints the comparison (TTFT, throughput, prompt tokens served from cache).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from kvserve.bench.cli import default_model_dir, tokenizer_for
from kvserve.bench.local_cluster import ClusterSpec, LocalCluster
from kvserve.bench.machine import describe_machine
from kvserve.bench.report import Run, markdown_table, write_report
from kvserve.bench.workloads import multi_turn_workload

KV_AWARE = "kv-aware + offload + shared tier"
BASELINE = "round robin, no offload"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", help="model directory (default: the tiny preset, created)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=1024, help="tokens of each first message")
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4, help="sessions in flight")
    p.add_argument("--num-kv-blocks", type=int, default=128, help="primary pool per engine")
    p.add_argument("--offload-gib", type=float, default=0.25, help="host KV tier per engine")
    p.add_argument(
        "--shared-tier-gib", type=float, default=1.0,
        help="a file-system KV tier shared by the engines, under --out (0: none)",
    )  # fmt: skip
    p.add_argument("--out", default="demo-results", help="where the report and plot go")
    p.add_argument("--seed", type=int, default=0)


def _phase(args, model_dir: Path, label: str, offload: bool, router_args: list[str]) -> Run:
    tiers: list[str] = []
    if offload and args.shared_tier_gib > 0:
        shared = Path(args.out).resolve() / "shared-kv"
        shutil.rmtree(shared, ignore_errors=True)  # every run starts cold
        tiers.append(f"fs:path={shared},size={args.shared_tier_gib}")
    spec = ClusterSpec(
        model_dir=str(model_dir),
        num_engines=args.engines,
        offload_gib=args.offload_gib if offload else 0.0,
        kv_tiers=tiers,
        engine_args=[
            *("--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", "16"),
            # Engines share this machine's cores: oversubscribed torch threads thrash.
            *("--num-threads", str(max(1, (os.cpu_count() or 1) // args.engines))),
        ],
        router_args=router_args,
    )
    vocab, tokenize = tokenizer_for(model_dir)
    workload = multi_turn_workload(
        num_sessions=args.sessions,
        num_turns=args.turns,
        first_len=args.first_len,
        user_len=48,
        output_len=args.output_len,
        think_time=0.1,
        vocab=vocab,
        seed=args.seed,
    )
    print(f"\n== {label}: starting {args.engines} engines + router ...", flush=True)
    t0 = time.monotonic()
    with LocalCluster(spec) as cluster:
        print(f"   up in {time.monotonic() - t0:.1f}s at {cluster.router_url}", flush=True)
        return cluster.run_workload(
            workload, concurrency=args.concurrency, label=label, seed=args.seed, tokenize=tokenize
        )


def run(args: argparse.Namespace) -> int:
    model_dir = Path(args.model_dir) if args.model_dir else default_model_dir("tiny")
    started = time.monotonic()
    runs = [
        _phase(args, model_dir, KV_AWARE, True, []),
        _phase(args, model_dir, BASELINE, False, ["--picker", "round_robin"]),
    ]
    summaries = [r.summary for r in runs]
    print()
    print(markdown_table(summaries, baseline=BASELINE))
    paths = write_report(
        args.out,
        runs,
        title="kvserve demo: multi-turn chat on 2 engines",
        machine=describe_machine(),
        workload=f"multi-turn: {args.sessions} sessions x {args.turns} turns",
        baseline=BASELINE,
        stem="demo",
    )
    print("report:", ", ".join(str(p) for p in paths.values()))
    print(f"done in {time.monotonic() - started:.0f}s")
    failed = sum(s.failed for s in summaries)
    return 1 if failed else 0
