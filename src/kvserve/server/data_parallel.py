"""`kvserve serve --data-parallel-size N`: N engine ranks, one process and one port each.

Owns the supervisor and the rank side of a data-parallel server:

- the supervisor (the process the user started) picks ports (rank ``r`` serves on
  ``port + r``; a KV event endpoint ``tcp://H:P`` becomes ``tcp://H:P+r``, its replay port
  too), a rendezvous port for expert parallelism, starts every rank as ``kvserve serve ...
  --data-parallel-rank r``, and watches them: the first rank to exit takes the group down
  (the others get SIGTERM, then SIGKILL) and the supervisor exits non-zero naming it and
  any rank that failed with it, so a dead rank never leaves its peers hanging in a
  collective. SIGINT/SIGTERM stop every rank.
- each rank is a whole server (scheduler, KV cache, /metrics, KV events with
  ``data_parallel_rank`` in every batch); with ``--enable-expert-parallel`` it joins the
  torch.distributed group before loading its share of the experts and steps in lockstep
  (:class:`kvserve.engine.parallel.ep_engine.ExpertParallelEngine`). A rank whose engine loop
  fails exits, which stops the group.
- rank 0 also honours ``X-data-parallel-rank: k`` (vLLM's and SGLang's header): the request
  is forwarded to rank ``k``'s port, its response streamed back unchanged.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from kvserve.config import EngineConfig, ParallelConfig, ServerConfig
from kvserve.cpu import usable_cores

logger = logging.getLogger(__name__)

RANK_HEADER = b"x-data-parallel-rank"
# A rank that does not exit within this long after SIGTERM is killed.
STOP_GRACE_S = 10.0


# ------------------------------------------------------------------------------- supervisor
def _free_port_block(host: str, n: int, attempts: int = 200) -> int:
    """A base port with ``n`` consecutive free ports."""
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        if all(_port_free(host, base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free ports on {host}")


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """``tcp://host:P`` -> ``tcp://host:P+rank`` (other forms unchanged: ``*`` ports, ipc)."""
    if not endpoint or rank == 0:
        return endpoint
    m = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if m is None:
        return endpoint
    return f"{m[1]}{int(m[2]) + rank}"


def check_parallel_config(engine: EngineConfig, parallel: ParallelConfig) -> None:
    """Refuse what cannot run, before any process starts."""
    n = parallel.data_parallel_size
    if n < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
    if parallel.data_parallel_rank is not None and not 0 <= parallel.data_parallel_rank < n:
        raise ValueError(f"--data-parallel-rank must be in [0, {n})")
    if parallel.enable_expert_parallel:
        from kvserve.model.config import ModelConfig

        mc = ModelConfig.from_pretrained(engine.model)
        if not mc.is_moe:
            raise ValueError(
                f"--enable-expert-parallel needs a mixture-of-experts model; "
                f"{mc.architecture} is dense"
            )
        if mc.num_experts % n:
            raise ValueError(
                f"--enable-expert-parallel: {mc.num_experts} experts do not split evenly "
                f"over --data-parallel-size {n}"
            )


def rank_argv(
    argv: list[str],
    rank: int,
    port: int,
    master_port: int,
    engine: EngineConfig,
    size: int = 1,
) -> list[str]:
    """The command line of rank ``rank`` of ``size``: the user's, with this rank's ports
    appended (argparse keeps the last value of a flag). Without ``--num-threads``, CPU ranks
    share the usable cores (``cores // size`` torch threads each, heavy steps too): each
    rank taking every core would oversubscribe them ``size`` times over."""
    out = [sys.executable, "-m", "kvserve.cli", *argv]
    out += ["--port", str(port), "--data-parallel-rank", str(rank)]
    out += ["--data-parallel-master-port", str(master_port)]
    if size > 1 and not engine.num_threads and engine.device != "cuda":
        out += ["--num-threads", str(max(1, usable_cores() // size))]
    for flag, value in (
        ("--kv-events-endpoint", engine.kv_events_endpoint),
        ("--kv-events-replay-endpoint", engine.kv_events_replay_endpoint),
    ):
        shifted = offset_endpoint(value, rank)
        if shifted != value:
            out += [flag, shifted]
    return out


def run_supervisor(
    engine: EngineConfig,
    server: ServerConfig,
    parallel: ParallelConfig,
    argv: list[str] | None = None,
) -> int:
    """Start the ranks and wait; the exit code is 0 only when stopped by a signal."""
    n = parallel.data_parallel_size
    argv = list(sys.argv[1:] if argv is None else argv)
    base = server.port or _free_port_block(server.host, n)
    master = parallel.data_parallel_master_port or _free_port_block("127.0.0.1", 1)
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    procs: list[subprocess.Popen] = []
    for r in range(n):
        cmd = rank_argv(argv, r, base + r, master, engine, n)
        # Own process group per rank: a terminal's Ctrl-C reaches the supervisor only.
        procs.append(subprocess.Popen(cmd, start_new_session=True))
    mode = "expert-parallel" if parallel.enable_expert_parallel else "independent"
    print(
        f"kvserve: {n} data-parallel ranks ({mode}) on http://{server.host}:{base}"
        f"..{base + n - 1} (X-data-parallel-rank on :{base})",
        file=sys.stderr,
        flush=True,
    )
    code = 0
    try:
        while not stop.is_set():
            if any(p.poll() is not None for p in procs):
                # Peers of a dead rank fail in their next collective and exit too: name them
                # all (a signal is the likely first cause; code 3 is "engine failed").
                time.sleep(0.5)
                dead = [(r, p.poll()) for r, p in enumerate(procs) if p.poll() is not None]
                what = "; ".join(f"rank {r} {_exit_text(rc)}" for r, rc in dead)
                print(
                    f"kvserve: data-parallel {what}; stopping the group",
                    file=sys.stderr,
                    flush=True,
                )
                code = 1
                break
            stop.wait(0.2)
    finally:
        _stop_all(procs)
    return code


def _exit_text(rc: int | None) -> str:
    if rc is not None and rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with code {rc}"


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ------------------------------------------------------------------------------- rank side
def build_rank_engine(engine_config: EngineConfig, parallel: ParallelConfig) -> Any:
    """This rank's engine: with expert parallelism, join the group first (the model loads
    only this rank's experts) and step in lockstep."""
    from kvserve.engine.engine import LLMEngine

    if not parallel.enable_expert_parallel or parallel.data_parallel_size == 1:
        return LLMEngine(engine_config)
    from kvserve.engine.parallel.ep_engine import ExpertParallelEngine
    from kvserve.engine.parallel.group import init_expert_parallel

    group = init_expert_parallel(
        parallel.data_parallel_rank or 0,
        parallel.data_parallel_size,
        parallel.data_parallel_master_port,
        backend=parallel.data_parallel_backend,
        device=engine_config.device,
    )
    return ExpertParallelEngine(engine_config, group)


def watch_rank(async_engine: Any, rank: int, interval_s: float = 0.2) -> None:
    """A daemon thread that ends this rank's process when its engine loop fails or its
    supervisor is gone (killed): the group never outlives either."""
    parent = os.getppid()

    def watch() -> None:
        while async_engine.error is None:
            if os.getppid() != parent:
                print(f"kvserve: data-parallel rank {rank}: supervisor gone", file=sys.stderr)
                os._exit(4)
            time.sleep(interval_s)
        print(
            f"kvserve: data-parallel rank {rank}: engine failed: {async_engine.error!r}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)

    threading.Thread(target=watch, name="kvserve-rank-watchdog", daemon=True).start()


class RankForwarder:
    """ASGI middleware of rank 0: a request with ``X-data-parallel-rank: k`` (k != own rank)
    is proxied to rank ``k`` at ``base_port + k``; a bad value is a 400."""

    def __init__(self, app: Any, rank: int, size: int, host: str, base_port: int) -> None:
        import httpx

        self.app = app
        self.rank, self.size = rank, size
        self.host = "127.0.0.1" if host in ("", "0.0.0.0") else host
        self.base_port = base_port
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        raw = next((v for k, v in scope["headers"] if k == RANK_HEADER), None)
        if raw is None:
            return await self.app(scope, receive, send)
        try:
            target = int(raw)
            if not 0 <= target < self.size:
                raise ValueError
        except ValueError:
            return await _error(
                send,
                400,
                f"X-data-parallel-rank must be an integer in [0, {self.size}), got "
                f"{raw.decode('latin-1')!r}",
                "X-data-parallel-rank",
            )
        if target == self.rank:
            return await self.app(scope, receive, send)
        await self._forward(scope, receive, send, target)

    async def _forward(self, scope: dict, receive: Any, send: Any, target: int) -> None:
        import httpx

        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope.get("raw_path") or scope["path"].encode()
        url = f"http://{self.host}:{self.base_port + target}{path.decode('latin-1')}"
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"host", b"connection")]
        request = self.client.build_request(
            scope["method"], url, headers=headers, content=bytes(body)
        )
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            return await _error(send, 503, f"data-parallel rank {target} unreachable: {e}", None)
        try:
            out_headers = [
                (k.lower(), v)
                for k, v in resp.headers.raw
                if k.lower() not in (b"transfer-encoding", b"connection", b"keep-alive")
            ]
            await send(
                {"type": "http.response.start", "status": resp.status_code, "headers": out_headers}
            )
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await resp.aclose()


async def _error(send: Any, status: int, message: str, param: str | None) -> None:
    from kvserve.server.errors import APIError

    resp = APIError(message, status, param=param).response()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": resp.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": resp.body})
