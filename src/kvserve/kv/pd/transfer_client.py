"""The consumer's puller (TCP): background threads that pull leased blocks from producers
straight into the destination blocks of the KV pool.

Per job: connect, send the pull, read the header, compare the producer's chain hashes with the
request's own (a mismatch ends the pull there: another prompt, tenant or hash seed), then
``recv_into`` each run of consecutive destination blocks and verify its blocks' xxh3-64
digests (the producer sealed them right after its prefill), and tell the producer how many
blocks were good. Every socket operation is bounded by ``timeout`` seconds without progress and
the whole pull by a deadline, so a stalled or dead producer costs a bounded wait, then the
blocks after the last good one are recomputed. A cancelled job (its request aborted) has its
socket shut down, which wakes the thread at once; it is reported like any other, after which
its blocks may be freed.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time

from kvserve.kv.pd.block_memory import BlockMemory, block_runs, verify_blocks, xxh3
from kvserve.kv.pd.transport import Puller, PullJob
from kvserve.kv.pd.wire import (
    PROTOCOL_VERSION,
    PullDone,
    PullHeader,
    PullRequest,
    TransferError,
    io_batch,
    recv_into_exact,
    recv_msg,
    send_msg,
)

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 1.0
# A pull may take its no-progress timeout plus this long per byte (a floor of 64 MiB/s).
MIN_BYTES_PER_S = 64 << 20


class TcpPuller(Puller):
    def __init__(
        self,
        memory: BlockMemory,
        fingerprint: str,
        timeout: float = 10.0,
        num_threads: int = 2,
        wakeup: threading.Event | None = None,
    ) -> None:
        self.memory = memory
        self.fingerprint = fingerprint
        self.timeout = timeout
        self.wakeup = wakeup if wakeup is not None else threading.Event()
        self._jobs: queue.SimpleQueue[PullJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: list[PullJob] = []
        self._inflight = 0
        self._socks: dict[int, socket.socket] = {}  # job id -> its connection
        self._threads = [
            threading.Thread(target=self._loop, name=f"kvserve-pd-pull-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    # -- engine thread ------------------------------------------------------------------------
    def submit(self, job: PullJob) -> None:
        with self._lock:
            self._inflight += 1
        self._jobs.put(job)

    def cancel(self, job: PullJob) -> None:
        with self._lock:
            job.cancelled = True
            sock = self._socks.get(job.job_id)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def poll(self) -> list[PullJob]:
        with self._lock:
            out, self._done = self._done, []
        return out

    @property
    def num_inflight(self) -> int:
        return self._inflight

    def close(self) -> None:
        with self._lock:
            socks = list(self._socks.values())
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(5)

    # -- pull threads -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                # Cancelled before it started: only hand the lease back.
                self._pull(job, release=job.cancelled)
            except (OSError, TransferError) as e:
                job.error = f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - a failed pull is a recompute, never a crash
                logger.exception("P/D pull failed")
                job.error = f"{type(e).__name__}: {e}"
            if job.cancelled and job.error is None and job.good_blocks < job.num_blocks:
                job.error = "cancelled"
            job.seconds = time.perf_counter() - t0
            job.cpu_seconds = time.thread_time() - c0
            with self._lock:
                self._socks.pop(job.job_id, None)
                self._inflight -= 1
                self._done.append(job)
            self.wakeup.set()

    def _pull(self, job: PullJob, release: bool = False) -> None:
        mem = self.memory
        b = mem.block_bytes
        n = 0 if release else job.num_blocks
        end = job.start if release else job.end
        deadline = time.monotonic() + self.timeout + n * b / MIN_BYTES_PER_S
        # Handing a lease back is a courtesy (it expires anyway): it never holds a pull thread
        # long behind an unreachable producer.
        timeout = min(self.timeout, RELEASE_TIMEOUT_S) if job.release_only else self.timeout
        sock = socket.create_connection((job.host, job.port), timeout=timeout)
        try:
            with self._lock:
                if job.cancelled and not release:
                    release, n, end = True, 0, job.start  # hand the lease back, no more
                self._socks[job.job_id] = sock
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ranges = list(job.ranges) if job.ranges is not None and not release else []
            send_msg(
                sock,
                PullRequest(
                    PROTOCOL_VERSION, job.lease_id, self.fingerprint, b, job.start, end, ranges
                ),
            )
            hdr = recv_msg(sock, PullHeader, deadline)
            if not hdr.ok:
                raise TransferError(f"refused by the producer: {hdr.error}")
            if hdr.block_bytes != b and n:
                raise TransferError(f"block of {hdr.block_bytes} bytes, expected {b}")
            if len(hdr.hashes) != n or len(hdr.digests) != n:
                raise TransferError(f"header names {len(hdr.hashes)} blocks, asked for {n}")
            # Blocks whose chain hash is ours; the first mismatch ends the pull.
            m = 0
            while m < n and hdr.hashes[m] == job.expected_hashes[m]:
                m += 1
            good = self._receive(sock, job, hdr.digests, m, deadline)
            job.good_blocks = good
            job.nbytes = good * b
            if good < job.num_blocks and not release:
                why = "chain hash mismatch" if good == m else "digest mismatch"
                job.error = f"{why} at block {job.start + good}"
            send_msg(sock, PullDone(ok=good == n, good_blocks=good, error=job.error or ""))
        finally:
            with self._lock:
                self._socks.pop(job.job_id, None)
            sock.close()

    def _receive(
        self, sock: socket.socket, job: PullJob, digests: list[int], m: int, deadline: float
    ) -> int:
        """Receive the first ``m`` blocks into their destinations; returns how many leading
        blocks verified."""
        mem = self.memory
        if not mem.is_cuda:
            runs = block_runs(job.dst_block_ids[:m])
            views = [mem.view(first, count) for first, count, _ in runs]
            return recv_verified(sock, views, mem.block_bytes, digests, deadline)
        b = mem.block_bytes
        good = 0
        # CUDA (untested here): received into pinned host memory, verified, then copied.
        staging = mem.staging_buffer()
        host = memoryview(staging.numpy())
        per = staging.numel() // b
        for first, count, _ in block_runs(job.dst_block_ids[:m]):
            done = 0
            while done < count:
                k = min(per, count - done)
                recv_into_exact(sock, host[: k * b], deadline)
                ok = verify_blocks(host[: k * b], b, digests, good)
                if ok:
                    mem.stage_in(first + done, staging, ok * b)
                good += ok
                if ok < k:
                    return good
                done += k
        return good


def recv_verified(
    sock: socket.socket,
    views: list[memoryview],
    block_bytes: int,
    digests: list[int],
    deadline: float,
) -> int:
    """Receive into ``views`` (runs of whole blocks, in order), scattering each system call
    over several of them (:func:`io_batch`), and verify each block's digest as soon as it is
    complete (while the sender keeps filling the socket). Returns how many leading blocks
    verified; stops at the first that does not."""
    b = block_bytes
    total = sum(len(v) for v in views)
    received = 0
    i, off = 0, 0  # receive cursor: buffer, byte offset in it
    good = 0  # blocks verified
    vi, vblock = 0, 0  # verify cursor: buffer, block in it
    while received < total:
        if time.monotonic() > deadline:
            raise TransferError(f"deadline passed after {received} of {total} bytes")
        k = sock.recvmsg_into(io_batch(views, i, off))[0]
        if k == 0:
            raise TransferError(f"connection closed after {received} of {total} bytes")
        received += k
        while k:
            rest = len(views[i]) - off
            if k >= rest:
                k -= rest
                i, off = i + 1, 0
            else:
                off, k = off + k, 0
        complete = received // b
        while good < complete:
            v = views[vi]
            if xxh3(v[vblock * b : (vblock + 1) * b]) != digests[good]:
                return good
            good += 1
            vblock += 1
            if vblock * b == len(v):
                vi, vblock = vi + 1, 0
    return good
