"""`kvserve serve`: one engine behind the OpenAI-compatible HTTP API.

Owns process wiring only: flags from :class:`EngineConfig` and :class:`ServerConfig` (API
keys from ``--api-key``, else ``VLLM_API_KEY`` / ``KVSERVE_API_KEY``), the engine and its
thread, the optional KV event publisher (a step listener that publishes
``engine.take_kv_events()``), uvicorn with the guarded HTTP protocol (header and keep-alive
timeouts), and a clean shutdown on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from typing import Any

from kvserve.config import (
    EngineConfig,
    ParallelConfig,
    ServerConfig,
    add_dataclass_args,
    from_args,
    replace,
)

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, EngineConfig)
    add_dataclass_args(parser, ServerConfig)
    add_dataclass_args(parser, ParallelConfig)


def _advertised_host(host: str) -> str:
    """The address other machines reach us at (for the KV event topic)."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one), shared with child processes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def kv_event_listener(engine: Any, publisher: Any):
    """A step listener publishing the engine's KV events of each step (engine thread)."""

    def publish(_outputs: list) -> None:
        events = engine.take_kv_events()
        if events:
            publisher.publish(events)

    return publish


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.core_client import EngineClient, EngineCoreClient
    from kvserve.engine.engine import LLMEngine, dir_name
    from kvserve.server.api_server import build_app
    from kvserve.server.auth import resolve_api_keys
    from kvserve.server.http_protocol import uvicorn_config
    from kvserve.server.moe_metrics import register_expert_metrics

    try:
        engine_config: EngineConfig = from_args(EngineConfig, args)
    except ValueError as e:  # a bad flag value (kv_role, kv_transfer_config, block_size...)
        print(f"kvserve serve: {e}", file=sys.stderr)
        return 2
    server_config: ServerConfig = from_args(ServerConfig, args)
    if not engine_config.model:
        print("kvserve serve: --model DIR is required", file=sys.stderr)
        return 2
    if engine_config.kv_events_curve_secret_key or engine_config.kv_events_curve_allowed_clients:
        from kvserve.kv.event_curve import CurveKeyError, check_server_keys

        try:
            check_server_keys(
                engine_config.kv_events_curve_secret_key,
                engine_config.kv_events_curve_allowed_clients,
            )
        except CurveKeyError as e:
            print(f"kvserve serve: {e}", file=sys.stderr)
            return 2
    parallel: ParallelConfig = from_args(ParallelConfig, args)
    if parallel.data_parallel_size != 1 or parallel.enable_expert_parallel:
        from kvserve.server import data_parallel

        try:
            data_parallel.check_parallel_config(engine_config, parallel)
        except ValueError as e:
            print(f"kvserve serve: {e}", file=sys.stderr)
            return 2
        if parallel.data_parallel_rank is None and parallel.data_parallel_size > 1:
            logging.basicConfig(level=server_config.log_level.upper())
            return data_parallel.run_supervisor(engine_config, server_config, parallel)
    dp_rank = parallel.data_parallel_rank if parallel.data_parallel_size > 1 else None
    logging.basicConfig(level=server_config.log_level.upper())
    stop_signals: list[int] = []

    def note_signal(signum: int, _frame: Any) -> None:
        stop_signals.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, note_signal)
    sock = bind_socket(server_config.host, server_config.port)
    port = sock.getsockname()[1]

    if engine_config.kv_events_endpoint and not engine_config.kv_events_topic:
        name = engine_config.served_model_name or dir_name(engine_config.model)
        engine_config = replace(
            engine_config,
            kv_events_topic=f"kv@{_advertised_host(server_config.host)}:{port}@{name}",
        )
    publisher = None
    async_engine: EngineClient
    if dp_rank is None and server_config.engine_process:
        try:
            async_engine = EngineCoreClient(engine_config, log_level=server_config.log_level)
        except RuntimeError as e:
            print(f"kvserve serve: {e}", file=sys.stderr)
            sock.close()
            return 1
    elif dp_rank is None:
        async_engine = AsyncEngine(LLMEngine(engine_config))
    else:
        async_engine = AsyncEngine(data_parallel.build_rank_engine(engine_config, parallel))
    if engine_config.kv_events_endpoint and isinstance(async_engine, AsyncEngine):
        from kvserve.kv.event_publisher import ZmqEventPublisher

        engine = async_engine.engine
        publisher = ZmqEventPublisher(
            engine_config.kv_events_endpoint,
            engine_config.kv_events_replay_endpoint,
            engine_config.kv_events_topic,
            engine_config.kv_events_buffer,
            curve_secret_key=engine_config.kv_events_curve_secret_key,
            curve_allowed_clients=engine_config.kv_events_curve_allowed_clients,
            data_parallel_rank=dp_rank,
        )
        async_engine.step_listeners.append(kv_event_listener(engine, publisher))

    server_config.api_key = resolve_api_keys(server_config.api_key)
    app = build_app(async_engine, server_config)
    expert_load = async_engine.expert_load_source
    if expert_load is not None:
        register_expert_metrics(app.state.metrics.registry, expert_load, async_engine.model_name)
    if dp_rank is not None:
        data_parallel.watch_rank(async_engine, dp_rank)
        if dp_rank == 0:
            app.add_middleware(
                data_parallel.RankForwarder,
                rank=0,
                size=parallel.data_parallel_size,
                host=server_config.host,
                base_port=port,
            )
    server = uvicorn.Server(
        uvicorn_config(
            app,
            server_config,
            log_level=server_config.log_level,
            timeout_graceful_shutdown=5,
            access_log=server_config.log_level in ("debug", "info"),
        )
    )
    print(
        f"kvserve: serving {async_engine.model_name!r} on http://{server_config.host}:{port}"
        + (" (API key required)" if server_config.api_key else ""),
        file=sys.stderr,
        flush=True,
    )
    try:
        if not stop_signals:
            # uvicorn handles SIGINT/SIGTERM while serving (stop accepting, drain, lifespan
            # shutdown), then re-raises the signal: note_signal above turns that into a return.
            server.run(sockets=[sock])
    finally:
        async_engine.shutdown()
        if publisher is not None:
            publisher.close()
        sock.close()
    return 0
