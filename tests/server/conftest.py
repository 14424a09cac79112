"""Fixtures for server tests: a real engine on the tiny model behind a real uvicorn server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from kvserve.config import EngineConfig, ServerConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import LLMEngine
from kvserve.server.api_server import build_app
from kvserve.server.http_protocol import uvicorn_config

MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 64  # 63 usable blocks of 16 tokens


def engine_config(model_dir: Path, **overrides) -> EngineConfig:
    kwargs = dict(
        model=str(model_dir),
        num_kv_blocks=NUM_KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=16,
        max_num_batched_tokens=512,
    )
    kwargs.update(overrides)
    return EngineConfig(**kwargs)


@dataclass
class RunningServer:
    engine: LLMEngine
    async_engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread
    base_url: str

    @property
    def model(self) -> str:
        return self.engine.model_name

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kwargs
        )

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30, **kwargs)

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Until the engine holds no request and no block (fails the test otherwise)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.async_engine.stats()
            if (
                not self.engine.has_unfinished_requests()
                and self.async_engine.num_inflight == 0
                and stats.num_running == 0
                and stats.num_waiting == 0
                and stats.kv_cache_usage == 0.0
            ):
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle after {timeout}s: {self.async_engine.stats()}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.async_engine.shutdown()


def start_server(engine: LLMEngine, config: ServerConfig | None = None) -> RunningServer:
    """Serve ``engine`` with uvicorn on a free port in a background thread."""
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, config or ServerConfig())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(
            app, config or ServerConfig(), log_level="warning", timeout_graceful_shutdown=2
        )
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return RunningServer(engine, async_engine, server, thread, f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """One server per test module (the engine keeps its prefix cache across tests)."""
    running = start_server(LLMEngine(engine_config(tiny_model_dir)))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def server_factory(tiny_model_dir: Path):
    """``server_factory(**engine_config_overrides)`` -> a fresh :class:`RunningServer`."""
    started: list[RunningServer] = []

    def make(**overrides) -> RunningServer:
        running = start_server(LLMEngine(engine_config(tiny_model_dir, **overrides)))
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()
