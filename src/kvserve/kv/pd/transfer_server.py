"""The producer's block server (TCP): serves leased KV blocks to decode engines.

``max_connections`` threads each accept and serve one pull at a time (more pulls wait in the
listen backlog, bounded by the consumer's timeout); one thread seals each new lease (digests of
its blocks). A pull names its lease and the lease's block indices it wants (one range, or one per KV
cache group); the server checks
the lease and that the consumer's model fingerprint and block size are its own, then sends a
header (chain hash and sealed xxh3-64 digest per block) and the blocks' bytes straight from the
KV pool: one buffer per run of consecutive blocks, gathered into few ``sendmsg`` calls. Whatever
the outcome, the lease ends with the pull, and a stalled peer is cut after ``timeout`` seconds
without progress.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass

from kvserve.kv.pd.block_memory import BlockMemory, block_runs
from kvserve.kv.pd.leases import Lease, LeaseState, LeaseTable
from kvserve.kv.pd.transport import LeaseServer
from kvserve.kv.pd.wire import (
    PROTOCOL_VERSION,
    PullDone,
    PullHeader,
    PullRequest,
    TransferError,
    frame,
    recv_msg,
    send_msg,
    sendmsg_all,
)

logger = logging.getLogger(__name__)

ACCEPT_RETRY_S = 0.2  # pause after a failed accept (e.g. no file descriptor left)


@dataclass
class ServerCounts:
    pulls: int = 0  # connections that named a lease
    pulls_ok: int = 0  # the consumer verified every block it asked for
    pulls_failed: int = 0  # refused, broken off, or the consumer reported a bad block
    blocks_sent: int = 0
    bytes_sent: int = 0
    send_time_s: float = 0.0
    cpu_time_s: float = 0.0  # CPU time of the serving threads


def advertised_host(host: str) -> str:
    """The address peers reach a server bound to ``host`` at."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class TcpBlockServer(LeaseServer):
    def __init__(
        self,
        memory: BlockMemory,
        leases: LeaseTable,
        fingerprint: str,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 10.0,
        max_connections: int = 16,
    ) -> None:
        self.memory = memory
        self.leases = leases
        self.fingerprint = fingerprint
        self.timeout = timeout
        self.max_connections = max_connections
        self.counts = ServerCounts()
        self._counts_lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        self._sock = sock
        self._address = (advertised_host(host), sock.getsockname()[1])
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._to_seal: queue.SimpleQueue[Lease | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._seal_loop, name="kvserve-pd-seal", daemon=True)
        ] + [
            threading.Thread(target=self._accept_loop, name=f"kvserve-pd-serve-{i}", daemon=True)
            for i in range(max_connections)
        ]
        for t in self._threads:
            t.start()
        logger.info("P/D block server on %s:%d", *self._address)

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    # -- sealing ----------------------------------------------------------------------------
    def seal(self, lease: Lease) -> None:
        self._to_seal.put(lease)

    def _seal_loop(self) -> None:
        while True:
            lease = self._to_seal.get()
            if lease is None:
                return
            if lease.state != LeaseState.RELEASED:
                try:
                    lease.digests = self.memory.digests(lease.block_ids)
                except Exception:  # noqa: BLE001 - an unsealed lease is refused, never served
                    logger.exception("sealing lease of request %s failed", lease.req_id)
            lease.sealed.set()

    # -- serving ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        """One serving thread: accept a pull, serve it, repeat (the kernel wakes one)."""
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(ACCEPT_RETRY_S)  # e.g. out of file descriptors: retry later
                continue
            if self._stop.is_set():
                conn.close()
                return
            with self._conns_lock:
                self._conns.add(conn)
            self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        lease: Lease | None = None
        ok = False
        c0 = time.thread_time()
        try:
            conn.settimeout(self.timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + self.timeout
            req = recv_msg(conn, PullRequest, deadline)
            lease = self.leases.take(req.lease_id)
            with self._counts_lock:
                self.counts.pulls += 1
            error = self._refusal(req, lease)
            if error:
                if lease is None:
                    with self._counts_lock:
                        self.counts.pulls_failed += 1
                send_msg(conn, PullHeader(ok=False, error=error))
                return
            assert lease is not None and lease.digests is not None
            ranges = req.index_ranges()
            ids = [b for lo, hi in ranges for b in lease.block_ids[lo:hi]]
            header = PullHeader(
                ok=True,
                block_bytes=self.memory.block_bytes,
                hashes=[h for lo, hi in ranges for h in lease.block_hashes[lo:hi]],
                digests=[d for lo, hi in ranges for d in lease.digests[lo:hi]],
            )
            t0 = time.perf_counter()
            self._send_blocks(conn, frame(header), ids)
            dt = time.perf_counter() - t0
            # The bytes left the blocks; wait (bounded) for the consumer's verdict.
            done = recv_msg(conn, PullDone, time.monotonic() + self.timeout)
            ok = done.ok
            if not ok:
                logger.warning(
                    "P/D pull of request %s: consumer verified %d of %d blocks (%s)",
                    lease.req_id, done.good_blocks, len(ids), done.error,
                )  # fmt: skip
            with self._counts_lock:
                self.counts.blocks_sent += len(ids)
                self.counts.bytes_sent += len(ids) * self.memory.block_bytes
                self.counts.send_time_s += dt
        except (OSError, TransferError) as e:
            logger.info("P/D pull broken off: %s", e)
        except Exception:  # noqa: BLE001 - a bad peer must not take the server down
            logger.exception("P/D pull failed")
        finally:
            if lease is not None:
                self.leases.release(lease)
                with self._counts_lock:
                    if ok:
                        self.counts.pulls_ok += 1
                    else:
                        self.counts.pulls_failed += 1
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()
            with self._counts_lock:
                self.counts.cpu_time_s += time.thread_time() - c0

    def _refusal(self, req: PullRequest, lease: Lease | None) -> str:
        if req.version != PROTOCOL_VERSION:
            return f"protocol version {req.version} (server speaks {PROTOCOL_VERSION})"
        if lease is None:
            return "unknown, expired or already pulled lease"
        if req.fingerprint != self.fingerprint or req.block_bytes != self.memory.block_bytes:
            return (
                f"model/layout mismatch: consumer {req.fingerprint}/{req.block_bytes}B, "
                f"producer {self.fingerprint}/{self.memory.block_bytes}B"
            )
        ranges = req.index_ranges()
        for lo, hi in ranges:
            if not 0 <= lo <= hi <= lease.num_blocks:
                return f"blocks [{lo}, {hi}) outside the lease's {lease.num_blocks}"
        wanted = any(hi > lo for lo, hi in ranges)
        if wanted and not lease.sealed.wait(self.timeout):
            return "lease not sealed in time"
        if wanted and lease.digests is None:
            return "lease could not be sealed"
        return ""

    def _send_blocks(self, conn: socket.socket, header: bytes, block_ids: list[int]) -> None:
        """The header, then the blocks straight from the pool: one buffer per run of
        consecutive blocks, gathered into few system calls."""
        mem = self.memory
        if not mem.is_cuda:
            views = [mem.view(first, count) for first, count, _ in block_runs(block_ids)]
            sendmsg_all(conn, [memoryview(header), *views])
            return
        # CUDA (untested here): staged through pinned host memory, piece by piece.
        conn.sendall(header)
        staging = mem.staging_buffer()
        for first, count, _ in block_runs(block_ids):
            for piece in mem.stage_out(first, count, staging):
                conn.sendall(piece)

    def close(self) -> None:
        self._stop.set()
        self._to_seal.put(None)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes every accept() (Linux)
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(5)
        self._sock.close()
