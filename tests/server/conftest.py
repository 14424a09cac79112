"""Fixtures for server tests: a real engine on the tiny model behind a real uvicorn server."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
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
    """``server_factory(server_config=None, model_dir=None, **engine_config_overrides)`` -> a
    fresh :class:`RunningServer`."""
    started: list[RunningServer] = []

    def make(
        server_config: ServerConfig | None = None, model_dir: Path | None = None, **overrides
    ) -> RunningServer:
        engine = LLMEngine(engine_config(model_dir or tiny_model_dir, **overrides))
        running = start_server(engine, server_config)
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()


@dataclass
class ServeProcess:
    """A real `kvserve serve` process (its stderr kept in ``log``)."""

    proc: subprocess.Popen
    url: str
    log: list[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def children(self) -> list[int]:
        """Pids of the server's child processes (its engine core among them)."""
        out: list[int] = []
        for task in Path(f"/proc/{self.pid}/task").glob("*"):
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
        return out

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to the server and its children: SIGSTOP freezes the whole engine (its
        core process too), SIGCONT resumes it."""
        for pid in [self.pid, *self.children()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_serve_process(
    model_dir: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120.0
) -> ServeProcess:
    """``kvserve serve --model model_dir --port 0 *args``; returns once it listens."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "serve",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *args,
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def drain() -> None:  # keeps the pipe from filling up
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            lines.put(line)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            proc.wait()
            raise RuntimeError("kvserve serve did not start: " + "".join(log)) from None
        if m := re.search(r"serving '[^']+' on (http://\S+)", line):
            return ServeProcess(proc, m.group(1), log)


@pytest.fixture(scope="session")
def long_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with 65,536 positions (same weights): prompts of millions of characters
    pass the character bound and must really be tokenized."""
    out = tmp_path_factory.mktemp("tiny_long") / "tiny-long"
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 65536
    (out / "config.json").write_text(json.dumps(cfg))
    return out
