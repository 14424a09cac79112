"""`kvserve up`: start the demo's local cluster (router + engines with KV offloading) and keep
it serving until Ctrl-C. With ``--api-key`` (or ``KVSERVE_API_KEY`` / ``VLLM_API_KEY``) the
router requires it, and the engines a key of their own that only the router holds."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
from pathlib import Path

from kvserve.bench.cli import default_model_dir
from kvserve.bench.local_cluster import ClusterSpec, LocalCluster


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", help="model directory (default: the tiny preset, created)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="ranks per engine (each its own KV cache and router endpoint; add "
        "`-- --enable-expert-parallel` for a MoE model)",
    )
    p.add_argument("--offload-gib", type=float, default=0.25)
    p.add_argument("--served-model-name", default="tiny")
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY") or os.environ.get("VLLM_API_KEY"),
        help="key clients must send to the router (default: $KVSERVE_API_KEY or $VLLM_API_KEY;"
        " none: open)",
    )
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- extra `kvserve serve` flags")


def run(args: argparse.Namespace) -> int:
    model_dir = Path(args.model_dir) if args.model_dir else default_model_dir("tiny")
    extra = [a for a in args.engine_args if a != "--"]
    spec = ClusterSpec(
        model_dir=str(model_dir),
        num_engines=args.engines,
        offload_gib=args.offload_gib,
        served_model_name=args.served_model_name,
        engine_args=extra,
        api_key=args.api_key,
        data_parallel_size=args.data_parallel_size,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LocalCluster(spec) as cluster:
        auth = ", API key required" if spec.api_key else ""
        print(f"router:  {cluster.router_url}/v1  (model {spec.served_model_name!r}{auth})")
        for url in cluster.engine_urls:
            print(f"engine:  {url}")
        print(f"logs:    {cluster.log_dir}\nCtrl-C to stop.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    return 0
