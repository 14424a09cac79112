"""`kvserve sim`: simulated engine instances serving the API, metrics and KV events of `serve`.

Owns process wiring only: flags, building a :class:`SimCluster`, an optional oracle router,
an optional endpoints file for `kvserve route`, and a clean shutdown on SIGINT/SIGTERM.

Examples::

    kvserve sim --port 8001                                    # one instance
    kvserve sim --num-instances 16 --base-port 8100 \\
        --kv-events-base-port 5600 --time-scale 4 --write-endpoints /tmp/eps.yaml
    kvserve route --endpoints-file /tmp/eps.yaml --tokenizer ~/.cache/kvserve/models/tiny

Instance ``i`` listens on ``base-port + i`` and publishes KV events on
``kv-events-base-port + 2i`` (replay ROUTER on ``+ 2i + 1``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from kvserve.config import EngineConfig, ServerConfig, add_dataclass_args, from_args
from kvserve.sim.latency_model import PRESETS, LatencyModel, get_preset

logger = logging.getLogger(__name__)

_INT_FIELDS = ("kv_bytes_per_token", "max_model_len", "default_kv_tokens")
_LATENCY_FIELDS = (
    "fixed",
    "prefill_per_token",
    "prefill_attn_per_ctx",
    "decode_per_seq",
    "decode_per_ctx",
    "cpu_bandwidth",
    "transfer_latency",
    "net_bandwidth",
    "net_latency",
    *_INT_FIELDS,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, EngineConfig)
    add_dataclass_args(parser, ServerConfig)
    g = parser.add_argument_group("simulation")
    g.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="h100-llama8b",
        help="latency model (see kvserve/sim/latency_model.py for sources)",
    )
    g.add_argument(
        "--latency",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"override one latency-model field ({', '.join(sorted(_LATENCY_FIELDS))})",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per modelled second: 4 runs 4x slower than the modelled hardware "
        "(room for many instances on few cores), 0.5 twice faster",
    )
    g.add_argument("--num-instances", type=int, default=1)
    g.add_argument("--base-port", type=int, help="port of instance 0 (default: --port)")
    g.add_argument(
        "--kv-events-base-port",
        type=int,
        help="publish KV events: instance i on this + 2i, replay on this + 2i + 1 (0: free)",
    )
    g.add_argument("--no-kv-events-replay", action="store_true", help="no replay sockets")
    g.add_argument(
        "--num-prefill-instances",
        type=int,
        default=0,
        help="P/D: the first N instances prefill (kv_role producer), the others decode "
        "(consumer); KV pulls take net_latency + bytes / net_bandwidth (default 0: no roles)",
    )
    g.add_argument(
        "--write-endpoints",
        metavar="FILE",
        help="write the instances as a `kvserve route --endpoints-file` YAML",
    )
    g.add_argument(
        "--oracle-port",
        type=int,
        help="also serve an oracle router on this port (reads every instance's exact cache "
        "and queues; the upper bound in routing benchmarks)",
    )


def latency_from_args(args: argparse.Namespace) -> LatencyModel:
    model = get_preset(args.preset)
    changes: dict[str, float] = {}
    for item in args.latency:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in _LATENCY_FIELDS:
            known = ", ".join(_LATENCY_FIELDS)
            raise ValueError(f"--latency {item!r}: expected FIELD=VALUE with FIELD in {known}")
        num = float(value)
        changes[key] = int(num) if key in _INT_FIELDS else num
    return model.replace(**changes) if changes else model


def write_endpoints(path: str, entries: list[dict], oracle_url: str | None = None) -> None:
    """``{"endpoints": [...]}`` (what `kvserve route --endpoints-file` reads), plus the
    oracle router's URL when one runs; written atomically once every instance serves."""
    import os

    import yaml

    doc: dict = {"endpoints": entries}
    if oracle_url:
        doc["oracle"] = oracle_url
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    os.replace(tmp, path)


async def serve(args: argparse.Namespace, ready: asyncio.Event | None = None) -> None:
    from kvserve.sim.instance import SimCluster, SimEngineConfig, default_model_dir

    engine_config = from_args(
        SimEngineConfig, args, sim_latency=latency_from_args(args), sim_time_scale=args.time_scale
    )
    server_config: ServerConfig = from_args(ServerConfig, args)
    if not engine_config.model:
        engine_config.model = str(default_model_dir())
    n = args.num_instances
    if n < 1:
        raise ValueError("--num-instances must be >= 1")
    if n > 1 and (engine_config.kv_events_endpoint or engine_config.kv_events_replay_endpoint):
        raise ValueError("several instances: use --kv-events-base-port, not --kv-events-endpoint")
    base_port = args.base_port if args.base_port is not None else server_config.port
    loop = asyncio.get_running_loop()
    cluster = await loop.run_in_executor(
        None,
        lambda: SimCluster.build(
            n,
            engine_config,
            server_config,
            base_port=base_port,
            kv_events_base_port=args.kv_events_base_port,
            replay=not args.no_kv_events_replay,
            num_prefill=args.num_prefill_instances,
        ),
    )
    router = None
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await cluster.start()
        if args.oracle_port is not None:
            from kvserve.sim.oracle import start_oracle_router

            router = await start_oracle_router(
                cluster, args.oracle_port, host=server_config.host, tokenizer=engine_config.model
            )
        oracle_url = None if router is None else f"http://{server_config.host}:{router.port}"
        if args.write_endpoints:
            write_endpoints(args.write_endpoints, cluster.endpoints(), oracle_url)
        for inst in cluster.instances:
            ev = f" events {inst.kv_events}" if inst.kv_events else ""
            print(f"kvserve sim: {inst.name} {inst.url}{ev}", file=sys.stderr, flush=True)
        if oracle_url is not None:
            print(f"kvserve sim: oracle router {oracle_url}", file=sys.stderr, flush=True)
        print(
            f"kvserve sim: {n} instance(s) of {cluster.instances[0].engine.model_name} ready",
            file=sys.stderr,
            flush=True,
        )
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        if router is not None:
            await router.stop()
        await cluster.stop()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=(args.log_level or "warning").upper())
    try:
        asyncio.run(serve(args))
    except (ValueError, OSError) as e:
        print(f"kvserve sim: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0
