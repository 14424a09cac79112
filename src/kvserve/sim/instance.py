"""Simulated engine instances: the real engine + server stack around a :class:`SimModelRunner`.

Owns building one simulated engine (:func:`build_sim_engine`), one served instance
(:class:`SimInstance`: ``AsyncEngine`` thread, the FastAPI app of ``kvserve serve``, the ZMQ
KV event publisher, a uvicorn server) and a group of instances sharing one asyncio loop
(:class:`SimCluster`: 16 to 64 instances in one OS process, each with its own engine thread).
It owns no HTTP routes, metrics or event formats: those are the real server's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.config import EngineConfig, ServerConfig
from kvserve.server.cli import bind_socket as server_bind_socket
from kvserve.sim.latency_model import LatencyModel, get_preset
from kvserve.sim.runner import SimModelRunner

logger = logging.getLogger(__name__)


@dataclass
class SimEngineConfig(EngineConfig):
    """An :class:`EngineConfig` plus the latency model the sim's runner and tier use."""

    sim_latency: LatencyModel | str = "h100-llama8b"
    sim_time_scale: float = 1.0  # wall seconds per modelled second (2: twice slower)

    def __post_init__(self) -> None:
        if isinstance(self.sim_latency, str):
            self.sim_latency = get_preset(self.sim_latency)
        # The real tier and the real P/D transport need real KV tensors: modelled ones.
        pd = bool(self.kv_role or self.kv_transfer_config) or self.kv_connector in ("pd", "sim-pd")
        if self.kv_connector == "sim-pd" or (pd and self.kv_connector == "sim-offload"):
            self.kv_connector = None if self.kv_role else "pd"
        if not pd and self.kv_offload_size and self.kv_connector in (None, "offload"):
            self.kv_connector = "sim-offload"
        super().__post_init__()
        if self.kv_connector == "pd":
            self.kv_connector = "sim-pd"  # chained with "sim-offload" when there is a tier


# ---------------------------------------------------------------------------------------------
# The tokenizer directory


def default_model_dir() -> Path:
    """The ``tiny`` preset in the user's cache, created once (atomically) on first use."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvserve"
    target = root / "models" / "tiny"
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    from kvserve.model.presets import make_model

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        make_model(tmp, preset="tiny")
        try:
            tmp.rename(target)
        except OSError:  # another process created it meanwhile
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def special_token_ids(model_dir: str | Path) -> frozenset[int]:
    """Ids the sim never samples: the tokenizer's special tokens, BOS/EOS/PAD."""
    path = Path(model_dir)
    out: set[int] = set()
    tok = path / "tokenizer.json"
    if tok.is_file():
        for t in json.loads(tok.read_text()).get("added_tokens", []):
            if t.get("special", True):
                out.add(int(t["id"]))
    cfg = path / "config.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = data.get(key)
            out.update(i for i in (v if isinstance(v, list) else [v]) if isinstance(i, int))
    return frozenset(out)


def build_sim_engine(config: SimEngineConfig):
    """``LLMEngine(config, runner=SimModelRunner(...))``; the pool defaults to the preset's."""
    from kvserve.engine.engine import LLMEngine
    from kvserve.sim import offload, pd  # noqa: F401 - register "sim-offload", "sim-pd"

    latency = config.sim_latency
    assert isinstance(latency, LatencyModel)
    if not config.model:
        config.model = str(default_model_dir())
    if config.num_kv_blocks is None and latency.default_kv_tokens:
        config.num_kv_blocks = latency.default_kv_tokens // config.block_size + 1
    if config.served_model_name is None:
        config.served_model_name = f"sim-{latency.name}"
    vocab, excluded = _vocabulary(str(Path(config.tokenizer or config.model).resolve()))
    runner = SimModelRunner(
        latency,
        vocab_size=vocab,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        time_scale=config.sim_time_scale,
        seed=config.seed,
        special_ids=excluded,
    )
    return LLMEngine(config, runner=runner)


@functools.cache
def _vocabulary(model_dir: str) -> tuple[int, frozenset[int]]:
    """Vocabulary size and the ids never sampled: special tokens and tokens that decode to
    nothing printable (raw bytes, control characters)."""
    from kvserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    excluded = set(special_token_ids(model_dir))
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i], skip_special_tokens=False)
        if not text.strip() or not text.isprintable():
            excluded.add(i)
    return tokenizer.vocab_size, frozenset(excluded)


# ---------------------------------------------------------------------------------------------
# Serving


class _Server:
    """uvicorn's server without its signal capture (many share one loop; the owner stops
    them all)."""

    @staticmethod
    def make(app, log_level: str):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        config = uvicorn.Config(
            app, log_level=log_level, timeout_graceful_shutdown=2, access_log=False, lifespan="on"
        )
        return Server(config)


def bind_socket(host: str, port: int) -> socket.socket:
    sock = server_bind_socket(host, port)
    sock.setblocking(False)
    return sock


@dataclass
class InstanceSpec:
    """Where one instance listens."""

    name: str
    port: int = 0  # 0: a free port
    kv_events_endpoint: str | None = None  # e.g. tcp://*:5557 ("tcp://127.0.0.1:*": free)
    kv_events_replay_endpoint: str | None = None
    kv_role: str | None = None  # P/D: producer (prefill) | consumer (decode) | both


# A P/D role as the router's endpoint role.
_ROUTER_ROLES = {"producer": "prefill", "consumer": "decode", "both": "both"}


class SimInstance:
    """One simulated engine served over HTTP, with metrics and KV events (like `serve`)."""

    def __init__(
        self, spec: InstanceSpec, engine_config: SimEngineConfig, server_config: ServerConfig
    ) -> None:
        from kvserve.engine.async_engine import AsyncEngine
        from kvserve.server.api_server import build_app

        self.spec = spec
        self.name = spec.name
        self.server_config = server_config
        self.sock = bind_socket(server_config.host, spec.port)
        self.port: int = self.sock.getsockname()[1]
        pd: dict = {}
        if spec.kv_role:
            pd = {"kv_role": spec.kv_role, "kv_engine_id": engine_config.kv_engine_id or spec.name}
        cfg = dataclasses.replace(
            engine_config,
            kv_events_endpoint=spec.kv_events_endpoint,
            kv_events_replay_endpoint=spec.kv_events_replay_endpoint,
            **pd,
        )
        self.kv_role = cfg.kv_role
        self.engine = build_sim_engine(cfg)
        self.runner: SimModelRunner = self.engine.runner  # type: ignore[assignment]
        # Requests the engine accepted (the oracle router tells routed-but-not-arrived ones).
        self.num_added = 0
        add = self.engine.add_request

        def counted_add(*a, **kw):
            rid = add(*a, **kw)
            self.num_added += 1
            return rid

        self.engine.add_request = counted_add  # type: ignore[method-assign]
        self.async_engine = AsyncEngine(self.engine)
        self.publisher = None
        if spec.kv_events_endpoint:
            from kvserve.kv.event_publisher import ZmqEventPublisher
            from kvserve.server.cli import kv_event_listener

            host = _advertised_host(server_config.host)
            topic = cfg.kv_events_topic or f"kv@{host}:{self.port}@{self.engine.model_name}"
            self.publisher = ZmqEventPublisher(
                spec.kv_events_endpoint, spec.kv_events_replay_endpoint, topic, cfg.kv_events_buffer
            )
            self.async_engine.step_listeners.append(kv_event_listener(self.engine, self.publisher))
        self.app = build_app(self.async_engine, server_config)
        self.app.add_api_route("/sim/stats", self.sim_stats, methods=["GET"])
        self.server = _Server.make(self.app, server_config.log_level)

    async def sim_stats(self) -> dict:
        """The runner's modelled vs slept time: ``overrun_s`` > 0 means the host could not keep
        the modelled pace (CPU contention); results are then pessimistic."""
        s = self.runner.snapshot()
        return {
            "name": self.name,
            "latency_model": self.runner.latency.name,
            "time_scale": self.runner.time_scale,
            "steps": s.steps,
            "modelled_s": s.modelled_s,
            "slept_s": s.slept_s,
            "overrun_s": s.overrun_s,
            # >1: busy steps took longer than modelled (host too slow for this time scale)
            "pace": s.busy_wall_s / s.busy_modelled_s if s.busy_modelled_s else None,
            "busy_wall_s": s.busy_wall_s,
            "busy_modelled_s": s.busy_modelled_s,
            "prefill_tokens": s.prefill_tokens,
            "decode_tokens": s.decode_tokens,
        }

    @property
    def url(self) -> str:
        host = self.server_config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{host}:{self.port}"

    @property
    def kv_events(self) -> str | None:
        return _connect_addr(self.publisher.endpoint) if self.publisher else None

    @property
    def kv_events_replay(self) -> str | None:
        if self.publisher is None or not self.publisher.replay_endpoint:
            return None
        return _connect_addr(self.publisher.replay_endpoint)

    def endpoint_entry(self) -> dict:
        """This instance as a router endpoint (``kvserve route`` YAML / endpoints file)."""
        entry: dict = {"url": self.url, "name": self.name, "model": self.engine.model_name}
        if self.kv_events:
            entry["kv_events"] = self.kv_events
        if self.kv_events_replay:
            entry["kv_events_replay"] = self.kv_events_replay
        if self.kv_role:
            entry["role"] = _ROUTER_ROLES[self.kv_role]
        return entry

    async def serve(self) -> None:
        await self.server.serve(sockets=[self.sock])

    def request_stop(self) -> None:
        self.server.should_exit = True

    def close(self) -> None:
        """Stop the engine thread and the publisher (after the server stopped)."""
        self.async_engine.shutdown()
        if self.publisher is not None:
            self.publisher.close()
        self.sock.close()


def _advertised_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def _connect_addr(bound: str) -> str:
    """A bound ZMQ address as peers connect to it (``tcp://0.0.0.0:P`` -> 127.0.0.1)."""
    return bound.replace("0.0.0.0", "127.0.0.1").replace("tcp://*:", "tcp://127.0.0.1:")


@dataclass
class SimCluster:
    """Many simulated instances in one process and one asyncio loop."""

    instances: list[SimInstance] = field(default_factory=list)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        num_instances: int,
        engine_config: SimEngineConfig,
        server_config: ServerConfig,
        *,
        base_port: int = 0,
        kv_events_base_port: int | None = None,
        kv_events_host: str = "127.0.0.1",
        replay: bool = True,
        num_prefill: int = 0,
    ) -> SimCluster:
        """Instance ``i`` listens on ``base_port + i`` (free ports when 0) and publishes KV
        events on ``kv_events_base_port + 2i`` (replay on ``+ 2i + 1``; free ports when 0;
        no events when None). ``num_prefill`` > 0: P/D, the first ``num_prefill`` instances
        are prefill instances (``kv_role`` producer), the others decode instances (consumer)."""
        if not 0 <= num_prefill < num_instances and num_prefill:
            raise ValueError("num_prefill must leave at least one decode instance")
        cluster = cls()
        try:
            for i in range(num_instances):
                # One instance may take the engine config's own event endpoints.
                ev, rp = engine_config.kv_events_endpoint, engine_config.kv_events_replay_endpoint
                if kv_events_base_port is not None or num_instances > 1:
                    ev = rp = None
                if kv_events_base_port is not None:
                    if kv_events_base_port:
                        ev = f"tcp://{kv_events_host}:{kv_events_base_port + 2 * i}"
                        rp = f"tcp://{kv_events_host}:{kv_events_base_port + 2 * i + 1}"
                    else:
                        ev = f"tcp://{kv_events_host}:*"
                        rp = f"tcp://{kv_events_host}:*"
                spec = InstanceSpec(
                    name=f"sim{i}",
                    port=base_port + i if base_port else 0,
                    kv_events_endpoint=ev,
                    kv_events_replay_endpoint=rp if replay else None,
                    kv_role=None
                    if not num_prefill
                    else "producer"
                    if i < num_prefill
                    else "consumer",
                )
                cluster.instances.append(SimInstance(spec, engine_config, server_config))
        except BaseException:
            cluster.close()
            raise
        return cluster

    async def start(self) -> None:
        """Start serving every instance; returns once all accept connections."""
        self._tasks = [asyncio.create_task(inst.serve()) for inst in self.instances]
        while not all(inst.server.started for inst in self.instances):
            for t in self._tasks:
                if t.done():
                    t.result()  # raise the startup failure
                    raise RuntimeError("a simulated instance stopped during startup")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        for inst in self.instances:
            inst.request_stop()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.close()

    def close(self) -> None:
        for inst in self.instances:
            with contextlib.suppress(Exception):
                inst.close()

    def endpoints(self) -> list[dict]:
        return [inst.endpoint_entry() for inst in self.instances]

    def by_name(self) -> dict[str, SimInstance]:
        return {inst.name: inst for inst in self.instances}
