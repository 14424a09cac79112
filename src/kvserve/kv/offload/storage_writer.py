"""The storage writer process: the cascade's writes to the storage tiers, outside the engine's
process (no GIL hand-offs with the engine thread, no CPU time charged to its process).

Owns the writer process's life (start, operations, acknowledgements, death, shutdown) and the
process's own loop. The host tier's slots live in shared memory (a memfd,
``CpuBackend(shared=True)``), mapped read-only here; the engine sends, per write operation, only
the chunk keys, their offsets in host memory and each tier's targets (:meth:`begin_put`: a
private tier's slots); the writer makes each chunk's header (its xxh3-128, once for all tiers),
writes every tier in turn (:meth:`put_planned`, on the tier's write side opened here by
``open_writer``) and acknowledges with what each tier holds and the tiers' counters, which the
engine publishes (:meth:`end_put`). The host slots stay pinned by the connector until then.

Messages are JSON, one per datagram, over an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket pair (no
pickle). The writer runs its threads under the write policy (``SCHED_IDLE`` by default), holds
writes to a duty cycle and waits while the engine pauses writes (a flag in a shared page: no
message per step). When the engine closes its end (shutdown, or the engine process died), the
writer finishes the writes it started, drops the queued ones and exits; when the writer dies,
the engine's reader sees the socket close and fails the operations in flight (the connector
unpins their slots; later writes are dropped and counted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvserve.kv.backends.chunk_format import ChunkCodec
from kvserve.kv.backends.storage import lower_thread_priority

logger = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20  # bytes of one datagram (an operation of a few hundred chunks is ~40 KB)
PAUSE_BOUND_S = 1.0  # longest a paused writer waits (a pause never resumed must not stall it)
PAUSE_POLL_S = 0.001
START_TIMEOUT_S = 30.0  # the writer's answer to the first message (imports, tier clients)
STOP_TIMEOUT_S = 10.0  # the writer's exit once the engine closed its end


@dataclasses.dataclass(frozen=True)
class TierWriterSpec:
    """How the writer process opens one tier's write side (``StorageBackend.writer_spec``)."""

    type: str  # registry name of the backend
    options: dict[str, Any]
    fds: list[int]  # inherited by the writer process, same numbers


# ================================================================================ engine side
class WriterProcess:
    """The engine's handle of one writer process. ``on_reply(op, reply)`` is called in a
    reader thread for every acknowledged operation, and with ``reply=None`` for each one in
    flight when the process died."""

    def __init__(
        self,
        codec: ChunkCodec,
        tiers: Sequence[TierWriterSpec],
        host_fd: int,
        host_bytes: int,
        on_reply: Callable[[int, dict[str, Any] | None], None],
        *,
        write_threads: int = 2,
        write_batch: int = 4,
        write_duty: float = 1.0,
        writer_policy: str = "idle",
    ) -> None:
        self._on_reply = on_reply
        self._lock = threading.Lock()
        self._inflight: set[int] = set()
        self._closing = False
        self.alive = True
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The pause flag: byte 0 of a shared page, read by the writer before each batch.
        self._ctrl_fd = os.memfd_create("kvserve-writer-ctrl", os.MFD_CLOEXEC)
        os.ftruncate(self._ctrl_fd, mmap.PAGESIZE)
        self._ctrl = mmap.mmap(self._ctrl_fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED)
        fds = [child.fileno(), host_fd, self._ctrl_fd, *(fd for t in tiers for fd in t.fds)]
        config = {
            "codec": dataclasses.asdict(codec),
            "host_fd": host_fd,
            "host_bytes": host_bytes,
            "ctrl_fd": self._ctrl_fd,
            "tiers": [dataclasses.asdict(t) for t in tiers],
            "threads": int(write_threads),
            "batch": int(write_batch),
            "duty": float(write_duty),
            "policy": writer_policy,
            "log_level": logging.getLogger("kvserve").getEffectiveLevel(),
        }
        import kvserve

        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.abspath(kvserve.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        # No linear algebra here: without this, numpy's OpenBLAS starts a thread per core
        # whose polling was ~13% of the writer's CPU under a heavy stream.
        env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvserve.kv.offload.storage_writer", str(child.fileno())],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            child.close()
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read_loop, name="kv-writer-ack", daemon=True)
        self._reader.start()
        try:
            self._sock.sendall(json.dumps(config).encode())
        except OSError as e:  # it died before reading its configuration
            self._died(f"its configuration could not be sent: {e}")

    # -- engine thread ---------------------------------------------------------------------
    def submit(
        self,
        op: int,
        keys: Sequence[bytes],
        offsets: Sequence[int],
        targets: Sequence[Sequence[int | None]],
    ) -> bool:
        """Send one write operation; False (nothing sent) when the writer is gone."""
        msg = {"op": op, "keys": [k.hex() for k in keys], "offs": list(offsets),
               "targets": [list(t) for t in targets]}  # fmt: skip
        with self._lock:
            if not self.alive or self._closing:
                return False
            self._inflight.add(op)
        try:
            self._sock.sendall(json.dumps(msg).encode())
        except OSError as e:
            with self._lock:
                self._inflight.discard(op)
            if e.errno == errno.EMSGSIZE:  # this operation only: too many chunks at once
                logger.warning(
                    "KV storage write of %d chunks too large for one message: not written "
                    "(lower kv_tier_max_pending_writes)", len(keys),
                )  # fmt: skip
            else:
                self._died(f"its socket refused an operation: {e}")
            return False
        return True

    def configure(
        self,
        *,
        duty: float | None = None,
        policy: str | None = None,
        fs_o_direct: bool | None = None,
    ) -> None:
        """Change the writer's duty cycle, its threads' scheduling policy, or whether its fs
        tiers write with O_DIRECT where they can (benchmarks: the same run compares both)."""
        msg = {"set": {"duty": duty, "policy": policy, "fs_o_direct": fs_o_direct}}
        with contextlib.suppress(OSError):
            self._sock.sendall(json.dumps(msg).encode())

    def pause(self) -> None:
        self._ctrl[0] = 1

    def resume(self) -> None:
        self._ctrl[0] = 0

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the writer: it ends the writes it started, drops the queued ones, exits;
        killed past ``timeout``. Operations not acknowledged are failed (``on_reply(op, None)``)."""
        with self._lock:
            self._closing = True
        self.resume()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("KV storage writer %d did not exit in %.0f s: killed", self.pid, timeout)
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout)
        self._fail_inflight()
        self._sock.close()
        self._ctrl.close()
        os.close(self._ctrl_fd)

    # -- reader thread ---------------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            try:
                reply = json.loads(data)
                op = int(reply["op"])
            except (ValueError, KeyError, TypeError):
                logger.error("KV storage writer %d: unreadable reply %r", self.pid, data[:80])
                break
            with self._lock:
                if op not in self._inflight:
                    continue
                self._inflight.discard(op)
            try:
                self._on_reply(op, reply)
            except Exception:  # a bug publishing one write must not stop the acknowledgements
                logger.exception("KV storage write %d: its acknowledgement failed", op)
        if not self._closing:
            self._died("its socket closed")
        self._fail_inflight()

    def _died(self, why: str) -> None:
        with self._lock:
            was, self.alive = self.alive, False
        if not was:
            return
        code = self.proc.poll()
        if code is None:  # a broken socket with the process still there: end it
            with contextlib.suppress(OSError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.proc.wait(STOP_TIMEOUT_S)
        logger.error(
            "KV storage writer %d died (%s, exit code %s): chunks are no longer written to the "
            "storage tiers (dropped, counted); the engine keeps serving",
            self.pid, why, code,
        )  # fmt: skip

    def _fail_inflight(self) -> None:
        with self._lock:
            ops, self._inflight = sorted(self._inflight), set()
        for op in ops:
            self._on_reply(op, None)


# ================================================================================ writer side
class _Writer:
    """The writer process's operations: chunks read in place from host memory, one header per
    chunk for all tiers, each tier written in turn, paced and paused as the engine asks."""

    def __init__(self, config: dict[str, Any], sock: socket.socket) -> None:
        from kvserve.kv.backends import backend_class

        self.sock = sock
        self.codec = ChunkCodec(**config["codec"])
        host = mmap.mmap(
            config["host_fd"], config["host_bytes"], flags=mmap.MAP_SHARED, prot=mmap.PROT_READ
        )
        self.host = memoryview(host)
        self.ctrl = mmap.mmap(
            config["ctrl_fd"], mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ
        )
        self.batch = max(1, int(config["batch"]))
        self.duty = float(config["duty"])
        self.tiers = []
        for t in config["tiers"]:
            cls: Any = backend_class(t["type"])
            self.tiers.append(cls.open_writer(self.codec, t["options"], list(t["fds"])))
        self._send_lock = threading.Lock()
        self._pace = threading.Lock()
        self._write_at = 0.0

    def configure(self, duty: float | None, policy: str | None, fs_o_direct: bool | None) -> None:
        if duty is not None:
            self.duty = float(duty)
        if policy is not None:
            set_process_policy(policy)
        if fs_o_direct is not None:
            for tier in self.tiers:
                if hasattr(tier, "use_o_direct"):
                    tier.use_o_direct(bool(fs_o_direct))

    def _wait_resumed(self) -> None:
        """While the engine pauses writes (a step computes), at most ``PAUSE_BOUND_S``."""
        deadline = time.monotonic() + PAUSE_BOUND_S
        while self.ctrl[0] and time.monotonic() < deadline:
            time.sleep(PAUSE_POLL_S)

    def _paced(self) -> None:
        self._wait_resumed()
        if self.duty < 1.0:
            with self._pace:
                wait = self._write_at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)

    def _spent(self, seconds: float) -> None:
        if self.duty < 1.0:
            with self._pace:
                now = time.perf_counter()
                self._write_at = max(self._write_at, now) + seconds * (1 / self.duty - 1)

    def run(self, msg: dict[str, Any]) -> None:
        t_start = time.perf_counter()
        keys = [bytes.fromhex(k) for k in msg["keys"]]
        size = self.codec.payload_bytes
        payloads = [self.host[o : o + size] for o in msg["offs"]]
        targets = msg["targets"]
        n = len(keys)
        ok = [[False] * n for _ in self.tiers]
        try:
            for lo in range(0, n, self.batch):
                hi = min(n, lo + self.batch)
                self._paced()
                t0 = time.perf_counter()
                headers = [self.codec.header(keys[i], payloads[i]) for i in range(lo, hi)]
                for t, tier in enumerate(self.tiers):
                    if t:
                        self._wait_resumed()
                    try:
                        res = tier.put_planned(
                            keys[lo:hi], payloads[lo:hi], headers, targets[t][lo:hi]
                        )
                    except Exception:  # a tier bug: these chunks are not in that tier
                        logger.exception("KV storage writer: tier %d failed a write", t)
                        continue
                    ok[t][lo:hi] = [bool(r) for r in res]
                self._spent(time.perf_counter() - t0)
        except Exception:
            logger.exception("KV storage writer: operation %s failed", msg.get("op"))
        stats = [tier.take_stats() for tier in self.tiers]
        reply = {"op": msg["op"], "ok": ok, "stats": stats, "s": time.perf_counter() - t_start}
        with self._send_lock, contextlib.suppress(OSError):
            self.sock.sendall(json.dumps(reply).encode())

    def close(self) -> None:
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                tier.close()


def set_thread_policy(tid: int, policy: str) -> None:
    """Thread ``tid`` to ``policy`` (``idle``: ``SCHED_IDLE``, ``nice``: nice 19, ``normal``:
    ``SCHED_OTHER`` at nice 0), from whatever it was."""
    with contextlib.suppress(OSError):
        if policy == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 19 if policy == "nice" else 0)


def set_process_policy(policy: str) -> None:
    """Every thread of this process to ``policy`` (:func:`set_thread_policy`)."""
    for tid in os.listdir("/proc/self/task"):
        set_thread_policy(int(tid), policy)


def main(argv: list[str] | None = None) -> int:
    """The writer process: ``python -m kvserve.kv.offload.storage_writer FD``."""
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    config = json.loads(sock.recv(MAX_MESSAGE))
    logging.basicConfig(
        level=config.get("log_level", logging.WARNING),
        format="%(asctime)s kvserve storage writer %(levelname)s %(name)s: %(message)s",
    )
    policy = config["policy"]
    lower_thread_priority(policy)  # threads started from here on inherit it
    writer = _Writer(config, sock)
    pool = ThreadPoolExecutor(
        config["threads"],
        thread_name_prefix="kv-storage-write",
        initializer=lower_thread_priority,
        initargs=(policy,),
    )
    try:
        while True:
            try:
                data = sock.recv(MAX_MESSAGE)
            except OSError:
                break
            if not data:  # the engine closed its end (shutdown, or it died)
                break
            msg = json.loads(data)
            if "set" in msg:
                opts = msg["set"]
                writer.configure(opts.get("duty"), opts.get("policy"), opts.get("fs_o_direct"))
                continue
            pool.submit(writer.run, msg)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        writer.close()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
