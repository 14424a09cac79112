"""`kvserve route`: run the KV-aware router (a YAML config, flags for the common cases).

Flags override the config file. Examples::

    kvserve route --config examples/router.yaml
    kvserve route --port 8080 --tokenizer /models/tiny \\
        --endpoint http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558 \\
        --endpoint http://127.0.0.1:8002,events=tcp://127.0.0.1:5567 \\
        --scorer precise_prefix=3 --scorer load=2
    kvserve route --tokenizer /models/tiny --pd-threshold 512 \
        --endpoint http://127.0.0.1:8001,role=prefill --endpoint http://127.0.0.1:8002,role=decode
    KVSERVE_API_KEY=sk-1 kvserve route --upstream-api-key sk-engines --endpoint ...

API keys: ``--api-key`` (repeatable), else ``KVSERVE_API_KEY`` and/or ``VLLM_API_KEY``; the key
sent to engines: ``--upstream-api-key``, else ``KVSERVE_UPSTREAM_API_KEY`` (or ``api_key=``
in an ``--endpoint``). Keys in the environment stay out of ``ps``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from kvserve.cluster.config import (
    ConfigError,
    EndpointSpec,
    PickerSpec,
    RouterConfig,
    ScorerSpec,
    load_router_config,
)

_ENDPOINT_KEYS = {
    "events": "kv_events",
    "replay": "kv_events_replay",
    "model": "model",
    "name": "name",
    "topic": "kv_events_topic",
    "api_key": "api_key",
    "curve_server_key": "kv_events_curve_server_key",
    "role": "role",
    "tier": "shared_tiers",  # repeatable
    "dp": "data_parallel_size",  # a data-parallel server: one endpoint per rank
}
API_KEY_ENV = ("KVSERVE_API_KEY", "VLLM_API_KEY")  # clients' keys
UPSTREAM_API_KEY_ENV = "KVSERVE_UPSTREAM_API_KEY"


def parse_endpoint_flag(text: str) -> EndpointSpec:
    """``URL[,events=ADDR][,replay=ADDR][,model=NAME][,name=NAME][,topic=T][,api_key=K]``
    ``[,curve_server_key=FILE][,role=prefill|decode|both][,tier=ID]...[,dp=N]``."""
    url, *opts = [p.strip() for p in text.split(",")]
    kwargs: dict[str, Any] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key not in _ENDPOINT_KEYS:
            raise ConfigError(
                f"--endpoint {text!r}: bad option {opt!r} (known: {', '.join(_ENDPOINT_KEYS)})"
            )
        if key == "tier":
            kwargs.setdefault("shared_tiers", []).append(value)
        else:
            kwargs[_ENDPOINT_KEYS[key]] = value
    return EndpointSpec(url=url, **kwargs)


def parse_scorer_flag(text: str) -> ScorerSpec:
    """``NAME=WEIGHT``."""
    name, sep, weight = text.partition("=")
    try:
        return ScorerSpec(name=name.strip(), weight=float(weight) if sep else 1.0)
    except ValueError:
        raise ConfigError(f"--scorer {text!r}: weight must be a number") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="router YAML config (see examples/router.yaml)")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8080)")
    parser.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="URL[,events=ADDR,...]",
        help="an engine server: URL[,events=tcp://H:P][,replay=tcp://H:P][,model=M][,name=N]"
        "[,role=prefill|decode|both] (repeatable; added to the config's endpoints)",
    )
    parser.add_argument(
        "--pd-threshold",
        type=int,
        metavar="TOKENS",
        help="prefill/decode disaggregation: split a request when the decode endpoint lacks "
        "at least this many of its prompt tokens (0: off, the default)",
    )
    parser.add_argument(
        "--pd-prefill-timeout",
        type=float,
        metavar="S",
        help="seconds a prefill leg may take before the decode endpoint serves alone (30)",
    )
    parser.add_argument(
        "--pd-prefill-max-active",
        type=int,
        metavar="N",
        help="prefill legs in flight (or requests waiting) that saturate a prefill endpoint (8)",
    )
    parser.add_argument("--endpoints-file", help="YAML/JSON endpoint list, re-read on change")
    parser.add_argument(
        "--endpoints-dns",
        action="append",
        default=[],
        metavar="dns://NAME:PORT[,events=tcp://{host}:P,...]",
        help="discover endpoints from the addresses of a DNS name (a headless Service), "
        "re-resolved every --endpoints-dns-interval s; options as --endpoint's, {host} and {ip} "
        "standing for each address (repeatable)",
    )
    parser.add_argument(
        "--endpoints-dns-interval", type=float, metavar="S", help="DNS re-resolution period (5)"
    )
    parser.add_argument(
        "--epp",
        action="store_true",
        help="also serve as a Gateway API Inference Extension Endpoint Picker: Envoy's ext_proc "
        "gRPC service (and gRPC health) on --epp-port",
    )
    parser.add_argument("--epp-port", type=int, help="the EPP's gRPC port (default 9002)")
    parser.add_argument(
        "--epp-transport",
        choices=["loop", "grpcio"],
        help="the EPP's gRPC server: loop (kvserve's HTTP/2 in the event loop, the default) "
        "or grpcio (grpc.aio)",
    )
    parser.add_argument("--tokenizer", help="model directory whose tokenizer the router uses")
    parser.add_argument("--block-size", type=int, help="block size of the routing history")
    parser.add_argument("--prefix-hash-seed", help="seed of the router's block keys")
    parser.add_argument(
        "--scorer",
        action="append",
        default=[],
        metavar="NAME=WEIGHT",
        help="replaces the configured scorers (repeatable): precise_prefix, approx_prefix, "
        "queue_depth, kv_cache_util, load, session_affinity",
    )
    parser.add_argument("--picker", help="max_score | weighted_random | random | round_robin")
    parser.add_argument("--session-header", help="header carrying the session id")
    parser.add_argument("--max-attempts", type=int, help="endpoints tried per request")
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a key clients must send as `Authorization: Bearer KEY` (repeatable; default: "
        "$KVSERVE_API_KEY or $VLLM_API_KEY; none: no authentication)",
    )
    parser.add_argument(
        "--upstream-api-key",
        help="bearer key sent to the engines (default: $KVSERVE_UPSTREAM_API_KEY; none: the "
        "client's Authorization header is passed on)",
    )
    parser.add_argument(
        "--max-connections-per-endpoint", type=int, help="connection cap (default 256)"
    )
    parser.add_argument(
        "--max-queue-per-endpoint",
        type=int,
        help="requests waiting for a connection (default 1024); beyond: 503 + Retry-After",
    )
    parser.add_argument("--max-body-bytes", type=int, help="request body limit (default 64 MiB)")
    parser.add_argument(
        "--kv-events-curve-client-key",
        metavar="FILE",
        help="the router's CURVE secret key file (ZeroMQ format) for engines whose KV event "
        "sockets use CURVE",
    )
    parser.add_argument(
        "--kv-events-curve-server-key",
        metavar="FILE",
        help="the engines' CURVE public key file (an endpoint's curve_server_key=FILE wins)",
    )
    parser.add_argument("--log-level", help="debug | info | warning | error")
    parser.add_argument(
        "--event-loop", help="auto (uvloop when installed) | uvloop | asyncio (default auto)"
    )


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    cfg = load_router_config(args.config) if args.config else RouterConfig()
    for attr in (
        "host",
        "port",
        "endpoints_file",
        "tokenizer",
        "block_size",
        "prefix_hash_seed",
        "session_header",
        "max_attempts",
        "log_level",
        "event_loop",
        "upstream_api_key",
        "max_connections_per_endpoint",
        "max_queue_per_endpoint",
        "max_body_bytes",
    ):
        value = getattr(args, attr, None)
        if value is not None:
            setattr(cfg, attr, value)
    for flag in ("curve_client_key", "curve_server_key"):
        value = getattr(args, "kv_events_" + flag, None)
        if value:  # replace(): the index config checks the key file
            cfg.index = dataclasses.replace(cfg.index, **{flag: value})
    cfg.endpoints = cfg.endpoints + [parse_endpoint_flag(e) for e in args.endpoint]
    if getattr(args, "epp_transport", None):
        cfg.epp_transport = args.epp_transport
    if getattr(args, "epp_port", None) is not None:
        cfg.epp_port = args.epp_port
    elif getattr(args, "epp", False) and cfg.epp_port is None:
        cfg.epp_port = 9002
    cfg.endpoints_dns = cfg.endpoints_dns + list(getattr(args, "endpoints_dns", None) or [])
    if getattr(args, "endpoints_dns_interval", None) is not None:
        cfg.endpoints_dns_poll_s = args.endpoints_dns_interval
    for flag, key in (
        ("pd_threshold", "threshold"),
        ("pd_prefill_timeout", "prefill_timeout_s"),
        ("pd_prefill_max_active", "prefill_max_active"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            setattr(cfg.pd, key, value)
    if args.api_key:
        cfg.api_keys = list(args.api_key)
    if not cfg.api_keys:  # both, when both are set (as `kvserve serve` does)
        cfg.api_keys = list(dict.fromkeys(os.environ[v] for v in API_KEY_ENV if os.environ.get(v)))
    if cfg.upstream_api_key is None and os.environ.get(UPSTREAM_API_KEY_ENV):
        cfg.upstream_api_key = os.environ[UPSTREAM_API_KEY_ENV]
    if args.scorer:
        cfg.scheduler.scorers = [parse_scorer_flag(s) for s in args.scorer]
    if args.picker:
        cfg.scheduler.picker = PickerSpec(args.picker)
    return cfg.validate()


def event_loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory for ``event_loop`` (``None``: asyncio's default loop)."""
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise ConfigError("event_loop uvloop: the uvloop package is not installed") from None
        return None
    return uvloop.new_event_loop


def run(args: argparse.Namespace) -> int:
    from kvserve.cluster.gateway import Router, serve_forever

    try:
        cfg = config_from_args(args)
        router = Router(cfg)
    except (ConfigError, ValueError) as e:
        print(f"kvserve route: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        loop_factory = event_loop_factory(cfg.event_loop)
    except ConfigError as e:
        print(f"kvserve route: {e}", file=sys.stderr)
        return 2
    if cfg.epp_port is not None:  # the same core, also behind Envoy's ext_proc
        from kvserve.cluster.epp.server import serve_forever
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve_forever(router))
    except KeyboardInterrupt:
        pass
    except OSError as e:  # e.g. the port is taken
        print(f"kvserve route: {e}", file=sys.stderr)
        return 1
    return 0
