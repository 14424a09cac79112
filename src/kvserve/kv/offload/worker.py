"""Transfer workers: asynchronous, batched copies between the primary pool and the host tier.

Owns transfer jobs and their execution; knows slots and block ids, never keys' meaning,
requests or eviction. A job copies whole engine blocks of a few chunks in one direction:

- store (primary -> tier): copy, then record each slot's header (key + checksum);
- load (tier -> primary): verify each chunk's header; chunks that do not verify are reported
  in ``bad_chunks`` (the caller turns them into a recompute of their blocks). The CPU worker
  verifies while its copy threads copy, so a bad chunk's bytes may reach its blocks; the CUDA
  worker verifies before it queues the copies.

On the CPU a store of whole chunks is planned on the engine thread that submits it (byte
segments and source checksums, one native call) and copied by a native thread, the store lane
(:meth:`~kvserve.kv.offload.block_copy.ForwardGate.lane`), which never takes the GIL: it copies
in pieces, each in a gap between forward passes (the engine's single-threaded scheduling and
output handling, where a core is free). The engine says when a forward begins and ends
(:meth:`forward_begins`, :meth:`forward_ends`: a native gate, a futex); a store waits while one
runs, for at most ``store_max_lag`` forward passes (or ``store_max_wait_s``) after it was
submitted, and while fewer than ``store_max_pending_blocks`` store blocks are pending; past that,
or when the engine waits for it (a flush, an idle engine), it copies at once, and it waits
while loads copy. The engine thread records the chunks' headers when :meth:`poll` takes the
completion. A Python transfer thread runs loads (requests wait for them; a load is cut into
pieces that copy threads, one per core, claim while the transfer thread verifies the chunks,
a step's loads as one batch) and, without the native extension, stores, waiting for the gaps
in Python (which cannot use them well: the engine thread holds the GIL in the gap). A store's
CPU time is counted apart when it ran during a forward pass
(:attr:`CpuTransferWorker.store_cpu_in_forward_s`).
On CUDA each job goes to a stream of a pool, ordered by events: a store first waits for the
compute stream (the forward that wrote its blocks), and completion is polled with
``Event.query()``. ``poll`` never blocks; ``wait`` does (flush before a preempted request's
blocks are reused); ``wait_any`` blocks, bounded, until some job ends (an idle engine sleeps on
it instead of spinning); ``cancel`` drops jobs not yet started.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.kv.backends.checksum import block_checksums, sampled_words
from kvserve.kv.backends.cpu import CpuBackend
from kvserve.kv.offload.block_copy import (
    GATED,
    CopyThreads,
    ForwardGate,
    as_byte_rows,
    copy_blocks,
    host_segments,
    plan_store,
)

logger = logging.getLogger(__name__)


@dataclass
class ChunkCopy:
    """Blocks ``offset .. offset + len(block_ids) - 1`` of the chunk in ``slot`` <-> these
    primary-pool blocks."""

    slot: int
    key: bytes
    block_ids: list[int]
    offset: int = 0


@dataclass
class WholeChunks:
    """Copies of whole chunks as columns: chunk ``i`` is tier slot ``slots[i]``, key
    ``keys[i]``, primary-pool blocks ``block_ids[i * k:(i + 1) * k]``. A store is built so, a
    few slices per request, rather than an object per chunk."""

    blocks_per_chunk: int
    slots: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)

    def add(self, slot: int, key: bytes, block_ids: list[int]) -> None:
        """One more chunk (``blocks_per_chunk`` blocks)."""
        self.slots.append(slot)
        self.keys.append(key)
        self.block_ids += block_ids

    def __len__(self) -> int:
        return len(self.slots)


class TransferJob:
    """Copies of a few chunks in one direction: ``chunks``, or, for whole chunks (every store),
    :class:`WholeChunks`, whose :class:`ChunkCopy` list is made only where a path needs one."""

    def __init__(self, job_id: int, is_store: bool, chunks: list[ChunkCopy] | WholeChunks):
        self.job_id = job_id
        self.is_store = is_store
        self.whole = chunks if isinstance(chunks, WholeChunks) else None
        self._chunks = None if self.whole is not None else chunks
        # The CPU worker's (or its gate's) forward-pass count, and time.monotonic(), at
        # submission.
        self.submitted_forward = 0
        self.submitted_at = 0.0
        # A CPU store's byte segments (:func:`host_segments`) and source checksums, prepared on
        # the submitting thread; None: the transfer thread works them out.
        self.segments: np.ndarray | None = None
        self.checksums: list[int] | None = None

    @property
    def chunks(self) -> list[ChunkCopy]:
        if self._chunks is None:
            w = self.whole
            k, ids = w.blocks_per_chunk, w.block_ids
            self._chunks = [
                ChunkCopy(slot, key, ids[i * k : (i + 1) * k])
                for i, (slot, key) in enumerate(zip(w.slots, w.keys, strict=True))
            ]
        return self._chunks

    @chunks.setter
    def chunks(self, chunks: list[ChunkCopy]) -> None:
        self._chunks, self.whole = chunks, None

    @property
    def keys(self) -> list[bytes]:
        return self.whole.keys if self.whole is not None else [c.key for c in self._chunks]

    @property
    def slots(self) -> list[int]:
        return self.whole.slots if self.whole is not None else [c.slot for c in self._chunks]

    @property
    def num_chunks(self) -> int:
        return len(self.whole) if self.whole is not None else len(self._chunks)

    @property
    def num_blocks(self) -> int:
        if self.whole is not None:
            return len(self.whole.block_ids)
        return sum(len(c.block_ids) for c in self._chunks)


@dataclass
class TransferResult:
    job_id: int
    ok: bool
    bad_chunks: list[int] = field(default_factory=list)  # indices into job.chunks
    nbytes: int = 0
    seconds: float = 0.0
    cancelled: bool = False


def _tier_ids(tier: CpuBackend, chunks: list[ChunkCopy]) -> list[int]:
    k = tier.layout.blocks_per_chunk
    return [c.slot * k + c.offset + j for c in chunks for j in range(len(c.block_ids))]


def _store_ids(tier: CpuBackend, chunks: list[ChunkCopy]) -> tuple[list[int], list[int]]:
    """A store's (primary-pool block, tier block) pairs, as two lists."""
    return [b for c in chunks for b in c.block_ids], _tier_ids(tier, chunks)


class TransferWorker:
    """Common interface of the CPU and CUDA workers."""

    def __init__(self, kv_cache: torch.Tensor, tier: CpuBackend) -> None:
        if tuple(kv_cache.shape[1:]) != tier.layout.block_shape:
            raise ValueError(
                f"kv_cache blocks {tuple(kv_cache.shape[1:])} do not match the tier's "
                f"{tier.layout.block_shape}"
            )
        if kv_cache.dtype != tier.blocks.dtype:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} != tier dtype {tier.blocks.dtype}")
        self.kv_cache = kv_cache
        self.tier = tier

    def submit(self, job: TransferJob) -> None:
        raise NotImplementedError

    def poll(self) -> list[TransferResult]:
        raise NotImplementedError

    def wait(self, job_ids: Iterable[int]) -> None:
        raise NotImplementedError

    def has_results(self) -> bool:
        """A result is ready to :meth:`poll`."""
        raise NotImplementedError

    def wait_any(self, timeout: float) -> None:
        """Block until a result is ready to :meth:`poll`, nothing is in flight, or ``timeout``
        seconds passed."""
        raise NotImplementedError

    def cancel(self, job_ids: Iterable[int]) -> set[int]:
        return set()

    def submit_many(self, jobs: Iterable[TransferJob]) -> None:
        for job in jobs:
            self.submit(job)

    def forward_begins(self) -> None:  # noqa: B027
        """The engine starts a forward pass (stores should keep off the CPU)."""

    def forward_ends(self) -> None:  # noqa: B027
        """The forward pass ended: stores may copy until the next one begins."""

    def shutdown(self) -> None:  # noqa: B027
        pass


class CpuTransferWorker(TransferWorker):
    """Stores on the native lane, in submission order; loads (and stores without the lane) on
    one background thread, loads first, each direction in submission order. Queued jobs of one
    direction run there as one batch: one pass of Python work and one set of copies for all of
    them, so the copies are as long as the block runs allow."""

    # Largest batch, in blocks (a batch in progress cannot be cancelled).
    max_batch_blocks = 4096
    # Most threads a load copies with (host memory bandwidth is reached well before).
    max_copy_threads = 8
    # Forward passes a store may wait for a gap between them, and seconds (a forward pass
    # that never ends: an engine that failed); then it copies regardless.
    store_max_lag = 4
    store_max_wait_s = 2.0
    # Store blocks submitted and not copied beyond which stores copy at once (lagging stores
    # hold their requests' blocks in the primary pool): set by the owner from the pool size.
    store_max_pending_blocks = 1 << 30
    # A store copies in pieces of this many bytes, looking between them for a forward pass
    # (natively: a piece that a forward pass begins under overlaps it by ~25 us at most).
    store_piece_bytes = 256 << 10 if GATED else 1 << 20

    def __init__(self, kv_cache: torch.Tensor, tier: CpuBackend, native: bool = True) -> None:
        """``native=False``: stores wait for the gaps in Python on the transfer thread, as
        without the extension (tests of that fallback)."""
        super().__init__(kv_cache, tier)
        self._kv_u8 = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)
        # Flat byte views that stores copy between (see :func:`host_segments`).
        self._store_src = as_byte_rows(kv_cache).reshape(-1)
        self._store_dst = as_byte_rows(tier.blocks).reshape(-1)
        layout = tier.layout
        # The checksum's sampled words, for plan_store (blocks of whole 64-bit words only).
        self._sampled = (
            sampled_words(layout.chunk_bytes, layout.blocks_per_chunk)
            if layout.block_bytes % 8 == 0
            else None
        )
        self._copy_threads = CopyThreads(min(torch.get_num_threads(), self.max_copy_threads))
        self._cond = threading.Condition()
        self._queue: deque[TransferJob] = deque()
        self._inflight: set[int] = set()  # submitted, result not produced yet
        self._results: list[TransferResult] = []
        self._stop = False
        self._in_forward = False
        self._forwards = 0  # forward passes begun
        self._urgent = 0  # callers waiting in wait()/wait_any(): stores copy at once
        self._queued_loads = 0
        self._pending_store_blocks = 0  # submitted, result not produced yet
        self._store_blocks: dict[int, int] = {}  # of each such store job
        self._gap_waiters = 0  # stores waiting in _hold_store for a forward pass to end
        self._gate = ForwardGate() if GATED and native else None  # else: _hold_store
        # Stores with their plan (every store of whole chunks) go to a native thread, which
        # copies them through the gate and never takes the GIL; this thread runs loads and
        # the rest. Lane jobs submitted whose completion poll() has not taken yet:
        self._lane = (
            self._gate.lane(self._store_src, self._store_dst, self.store_piece_bytes)
            if self._gate is not None
            else None
        )
        self._lane_jobs: dict[int, TransferJob] = {}
        self._loads_running = 0  # load batches taken and not published (stores yield to them)
        # Whether the gate says "in a forward pass": it is closed (and counts forward passes)
        # only while stores are pending, the only copies it holds; the engine thread's two
        # calls per step are then a check of one attribute (they run cache-cold, right after
        # a forward pass: ~5 us each measured with the native call).
        self._gate_closed = False
        # CPU seconds of this thread spent on stores, and the part of it during forward passes.
        self.store_cpu_s = 0.0
        self.store_cpu_in_forward_s = 0.0
        self._thread = threading.Thread(target=self._loop, name="kv-offload-worker", daemon=True)
        self._thread.start()

    def submit(self, job: TransferJob) -> None:
        self.submit_many((job,))

    def submit_many(self, jobs: Iterable[TransferJob]) -> None:
        jobs = list(jobs)
        for job in jobs:
            if job.is_store:
                self._prepare_store(job)
        with self._cond:
            if self._stop:
                raise RuntimeError("transfer worker is shut down")
            now = time.monotonic()
            queued = False
            for job in jobs:
                job.submitted_forward = self._forwards
                job.submitted_at = now
                if job.is_store and self._gate is not None:
                    if self._in_forward and not self._gate_closed:  # a store mid-forward
                        self._gate_closed = True
                        self._gate.forward(True)
                    job.submitted_forward = self._gate.forwards
                if job.is_store:
                    self._pending_store_blocks += job.num_blocks
                else:
                    self._queued_loads += 1
                if job.is_store and self._lane is not None and job.segments is not None:
                    self._lane_jobs[job.job_id] = job
                    continue
                if job.is_store:
                    self._store_blocks[job.job_id] = job.num_blocks
                self._inflight.add(job.job_id)
                self._queue.append(job)
                queued = True
            self._update_gate()  # before the lane sees the jobs: a backlog releases them
            if queued:  # the transfer thread has work (lane jobs never wake it)
                self._cond.notify_all()
        for job in jobs:
            if job.is_store and job.job_id in self._lane_jobs:
                try:
                    self._lane.submit(
                        job.job_id, job.segments,
                        _int32(job.submitted_forward + self.store_max_lag),
                        int((job.submitted_at + self.store_max_wait_s) * 1e9),
                    )  # fmt: skip
                except Exception:  # a plan out of bounds: fails alone, like a copy would
                    logger.exception("KV store job %d rejected", job.job_id)
                    with self._cond:
                        del self._lane_jobs[job.job_id]
                        self._pending_store_blocks -= job.num_blocks
                        bad = list(range(job.num_chunks))
                        self._results.append(TransferResult(job.job_id, False, bad))
                        self._update_gate()

    def _prepare_store(self, job: TransferJob) -> None:
        """A store's byte segments and the checksums of its source blocks, worked out here, on
        the engine thread that submits it (one native call for whole chunks: 0.14-0.31 ms for
        64 chunks, mostly the sampled lines' cache misses), rather than on the transfer thread:
        there, woken cold, numpy took 0.3-0.7 ms for the same while holding the GIL, and the
        engine's next forward pass waited for it. The source blocks are full and held until
        the store ends: their bytes cannot change meanwhile."""
        k = self.tier.layout.blocks_per_chunk
        try:
            whole = job.whole
            if whole is None and all(len(c.block_ids) == k for c in job.chunks):
                whole = WholeChunks(k)
                for c in job.chunks:
                    whole.add(c.slot, c.key, c.block_ids)
            if self._gate is not None and whole is not None and self._sampled:
                # Whole chunks (a store's are): segments and checksums in one native call.
                job.segments, job.checksums = plan_store(
                    self._store_src, self.tier.layout.block_bytes, k, self.tier.blocks.shape[0],
                    whole.block_ids, whole.slots, self._sampled,
                )  # fmt: skip
                return
            chunks = job.chunks
            src_ids = [b for c in chunks for b in c.block_ids]
            if self._gate is not None:
                job.segments = host_segments(
                    self.kv_cache, self.tier.blocks, src_ids, _tier_ids(self.tier, chunks)
                )[2]
            job.checksums = block_checksums(self._kv_u8, [c.block_ids for c in chunks], k)
        except Exception:  # a bad job fails on the transfer thread, as its copy would
            job.segments = job.checksums = None

    def forward_begins(self) -> None:
        self._forwards += 1
        self._in_forward = True  # read by the transfer thread between pieces (no lock)
        if self._pending_store_blocks and self._gate is not None:
            self._gate_closed = True
            self._gate.forward(True)

    def forward_ends(self) -> None:
        self._in_forward = False
        if self._gate_closed:
            self._gate_closed = False
            self._gate.forward(False)
        # Wake the transfer thread only when a store waits for this: a needless wake-up makes
        # it take the GIL from the engine thread (milliseconds on a loaded machine).
        if self._gap_waiters:
            with self._cond:
                self._cond.notify_all()

    def _store_may_copy(self, job: TransferJob) -> bool:
        """A store may copy now: no forward runs, it waited long enough, or someone waits."""
        return (
            not self._in_forward
            or self._urgent > 0
            or self._stop
            or self._forwards - job.submitted_forward > self.store_max_lag
            or self._pending_store_blocks > self.store_max_pending_blocks
            or time.monotonic() - job.submitted_at > self.store_max_wait_s
        )

    def _update_gate(self) -> None:
        """Tell a store waiting natively to copy at once, or to return for queued loads (the
        conditions of :meth:`_store_may_copy` that are not about time or forward passes). The
        caller holds ``_cond``."""
        if self._gate is not None:
            self._gate.release(
                self._urgent > 0
                or self._stop
                or self._pending_store_blocks > self.store_max_pending_blocks
            )
            self._gate.yield_(self._queued_loads > 0 or self._loads_running > 0)

    def _hold_store(self, job: TransferJob) -> bool:
        """Between a store's pieces: wait for the current forward pass to end, running loads
        submitted meanwhile (they never wait behind a store). Returns whether the piece about
        to be copied runs during a forward pass."""
        while True:
            if self._store_may_copy(job) and not self._queued_loads:
                return self._in_forward
            with self._cond:
                # Timeout: the lag bound moves with forward_begins, which does not notify.
                self._gap_waiters += 1
                self._cond.wait_for(
                    lambda: self._store_may_copy(job) or self._queued_loads, timeout=0.05
                )
                self._gap_waiters -= 1
                loads = self._take_batch(load=True) if self._queued_loads else []
            if loads:
                self._publish(self._run_safe(loads), loads=True)

    def _take_batch(self, load: bool) -> list[TransferJob]:
        """Queued jobs of one direction, in submission order, up to ``max_batch_blocks``
        (at least one). The caller holds ``_cond``."""
        batch: list[TransferJob] = []
        blocks = 0
        for job in self._queue:
            if job.is_store != load:
                batch.append(job)
                blocks += job.num_blocks
                if blocks >= self.max_batch_blocks:
                    break
        for job in batch:
            self._queue.remove(job)
        if load:
            self._queued_loads -= len(batch)
            self._loads_running += 1
            self._update_gate()
        return batch

    def _publish(self, results: list[TransferResult], loads: bool = False) -> None:
        """Publish a batch's results (``loads``: of a load batch, which stores yield to)."""
        with self._cond:
            for result in results:
                self._finish(result)
            if loads:
                self._loads_running -= 1
                self._update_gate()

    def _take_lane(self) -> list[TransferResult]:
        """The lane's ended stores as results, their headers recorded (on the polling thread:
        checksums of the source, computed at submission)."""
        done = self._lane.take_done()
        if not done:
            return []
        out = []
        block_bytes = self.tier.layout.block_bytes
        with self._cond:
            jobs = [self._lane_jobs.pop(jid) for jid, _, _, _ in done]
            for job in jobs:
                self._pending_store_blocks -= job.num_blocks
            self._update_gate()
        for job, (jid, in_forward_ns, cpu_ns, wall_ns) in zip(jobs, done, strict=True):
            self.tier.record(job.slots, job.keys, job.checksums)
            out.append(TransferResult(jid, True, [], job.num_blocks * block_bytes, wall_ns / 1e9))
            self.store_cpu_s += cpu_ns / 1e9
            self.store_cpu_in_forward_s += in_forward_ns / 1e9
        return out

    def poll(self) -> list[TransferResult]:
        lane = self._take_lane() if self._lane is not None and self._lane.has_done else []
        if not self._results:
            return lane
        with self._cond:
            out, self._results = self._results, []
        return out + lane

    def has_results(self) -> bool:
        return bool(self._results) or (self._lane is not None and self._lane.has_done)

    @property
    def thread_ids(self) -> list[int]:
        """Kernel thread ids of the transfer thread and the store lane's (CPU accounting)."""
        ids = [self._thread.native_id]
        if self._lane is not None and self._lane.native_id:
            ids.append(self._lane.native_id)
        return ids

    def _urgency(self, delta: int) -> None:
        """Someone starts (+1) or stops (-1) waiting for jobs: stores copy at once meanwhile."""
        with self._cond:
            self._urgent += delta
            self._update_gate()
            self._cond.notify_all()

    def wait(self, job_ids: Iterable[int]) -> None:
        ids = set(job_ids)
        lane_ids = [i for i in ids if i in self._lane_jobs]
        self._urgency(+1)
        try:
            if lane_ids:
                self._lane.wait(np.asarray(lane_ids, dtype=np.int64), 1e9)
            with self._cond:
                self._cond.wait_for(lambda: not (ids & self._inflight))
        finally:
            self._urgency(-1)

    def wait_any(self, timeout: float) -> None:
        self._urgency(+1)
        try:
            if self._inflight:  # loads (or stores without the lane): lane stores wait for them
                with self._cond:
                    self._cond.wait_for(lambda: self._results or not self._inflight, timeout)
            elif self._lane is not None and self._lane.pending:
                self._lane.wait_any(timeout)
        finally:
            self._urgency(-1)

    def cancel(self, job_ids: Iterable[int]) -> set[int]:
        ids = set(job_ids)
        lane_ids = [i for i in ids if i in self._lane_jobs]
        dropped_lane = self._lane.cancel(np.asarray(lane_ids, dtype=np.int64)) if lane_ids else []
        with self._cond:
            dropped = [j for j in self._queue if j.job_id in ids]
            for job in dropped:
                self._queue.remove(job)
                self._queued_loads -= not job.is_store
                self._finish(TransferResult(job.job_id, ok=False, cancelled=True))
            for jid in dropped_lane:
                self._pending_store_blocks -= self._lane_jobs.pop(jid).num_blocks
                self._results.append(TransferResult(jid, ok=False, cancelled=True))
            self._update_gate()
        return {j.job_id for j in dropped} | set(dropped_lane)

    def shutdown(self) -> None:
        if self._lane is not None:  # queued stores cancelled before the gate is released
            self.cancel(list(self._lane_jobs))
        with self._cond:
            self._stop = True
            for job in self._queue:
                self._finish(TransferResult(job.job_id, ok=False, cancelled=True))
            self._queue.clear()
            self._queued_loads = 0
            self._update_gate()
            self._cond.notify_all()
        if self._lane is not None:  # the store copying, released by the stop, finishes
            self._lane.close()
            ended = self._take_lane()
            with self._cond:
                self._results += ended
        self._thread.join(timeout=30)
        self._copy_threads.shutdown()

    def _finish(self, result: TransferResult) -> None:
        """Publish a result; the caller holds ``_cond``."""
        self._inflight.discard(result.job_id)
        if result.job_id in self._store_blocks:
            self._pending_store_blocks -= self._store_blocks.pop(result.job_id)
            self._update_gate()
        self._results.append(result)
        self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if self._stop and not self._queue:
                    return
                # Loads first (requests wait for them), then stores.
                load = self._queued_loads > 0
                batch = self._take_batch(load=load)
            self._publish(self._run_safe(batch), loads=load)

    def _run_safe(self, batch: list[TransferJob]) -> list[TransferResult]:
        """Run a batch; if it fails, each job alone, so that one bad job fails only itself."""
        try:
            return self._run(batch)
        except Exception:  # a failed copy must not kill the worker or the request
            if len(batch) > 1:
                return [r for job in batch for r in self._run_safe([job])]
            job = batch[0]
            logger.exception("KV transfer job %d failed", job.job_id)
            return [TransferResult(job.job_id, ok=False, bad_chunks=list(range(job.num_chunks)))]

    def _copy_store_held(self, batch: list[TransferJob]) -> list[float]:
        """A store batch's copy, piece by piece, each waiting in Python (:meth:`_hold_store`)
        for a gap between forward passes (lag and deadline from its first job), running loads
        queued meanwhile: stores without the native lane. Returns [CPU s copied during forward
        passes, CPU s of those loads]."""
        head, chunks = batch[0], [c for job in batch for c in job.chunks]
        # CPU time at the last piece, in forward passes so far, running loads meanwhile.
        cpu = [time.thread_time(), 0.0, 0.0]
        in_forward = [False]

        def between_pieces() -> None:
            now = time.thread_time()
            if in_forward[0]:
                cpu[1] += now - cpu[0]
            in_forward[0] = self._hold_store(head)
            cpu[0] = time.thread_time()
            cpu[2] += cpu[0] - now

        copy_blocks(
            self.kv_cache, self.tier.blocks, *_store_ids(self.tier, chunks),
            piece_bytes=self.store_piece_bytes, between_pieces=between_pieces,
        )  # fmt: skip
        if in_forward[0]:
            cpu[1] += time.thread_time() - cpu[0]
        return cpu[1:]

    def _run(self, batch: list[TransferJob]) -> list[TransferResult]:
        """Jobs of one direction as one transfer: one verification or header pass, one
        :func:`copy_blocks` (runs merge across jobs). Each job is charged its share of the
        batch's time, by bytes."""
        t0 = time.perf_counter()
        tier = self.tier
        if batch[0].is_store:
            t_cpu = time.thread_time()
            cpu = self._copy_store_held(batch)  # [CPU s in forward passes, of loads meanwhile]
            # Checksums of the source: a copy that went wrong fails the load's verification.
            if all(job.checksums is not None for job in batch):
                sums = [c for job in batch for c in job.checksums]
            else:
                sums = block_checksums(
                    self._kv_u8,
                    [c.block_ids for job in batch for c in job.chunks],
                    tier.layout.blocks_per_chunk,
                )
            slots = [s for job in batch for s in job.slots]
            tier.record(slots, [key for job in batch for key in job.keys], sums)
            good = None  # every chunk
            self.store_cpu_s += time.thread_time() - t_cpu - cpu[1]
            self.store_cpu_in_forward_s += cpu[0]
        else:
            # Every chunk is copied while this thread verifies them (the copy threads do not
            # wait for it): a chunk that fails is reported bad, and the connector has its blocks
            # and the request's later ones recomputed, so its copied bytes are never read.
            chunks = [c for job in batch for c in job.chunks]
            good = []
            copy_blocks(
                tier.blocks, self.kv_cache, _tier_ids(tier, chunks),
                [b for c in chunks for b in c.block_ids], threads=self._copy_threads,
                alongside=lambda: good.extend(
                    tier.verify([c.slot for c in chunks], [c.key for c in chunks])
                ),
            )  # fmt: skip
        seconds = time.perf_counter() - t0
        block_bytes = tier.layout.block_bytes
        # Per job: the indices of its chunks that failed, and its blocks that landed.
        bad_of: list[list[int]] = []
        blocks: list[int] = []
        i = 0
        for job in batch:
            if good is None:  # a store: every chunk
                bad_of.append([])
                blocks.append(job.num_blocks)
                continue
            ok = good[i : i + job.num_chunks]
            i += job.num_chunks
            bad_of.append([j for j, g in enumerate(ok) if not g])
            blocks.append(sum(len(c.block_ids) for c, g in zip(job.chunks, ok, strict=True) if g))
        total = sum(blocks)
        shares = [n / total if total else 1.0 / len(batch) for n in blocks]
        return [
            TransferResult(job.job_id, not bad, bad, n * block_bytes, seconds * share)
            for job, bad, n, share in zip(batch, bad_of, blocks, shares, strict=True)
        ]


class CudaTransferWorker(TransferWorker):  # pragma: no cover - needs CUDA
    """Jobs on a pool of dedicated streams, completion tracked with events."""

    NUM_STREAMS = 8

    def __init__(self, kv_cache: torch.Tensor, tier: CpuBackend) -> None:
        super().__init__(kv_cache, tier)
        if not tier.pinned:
            logger.warning("KV offload tier is not pinned: CUDA copies will be synchronous")
        self._device = kv_cache.device
        self._streams = [torch.cuda.Stream(device=self._device) for _ in range(self.NUM_STREAMS)]
        self._next = 0
        # job_id -> (job, start event, done event, bad chunk indices)
        self._inflight: dict[int, tuple[TransferJob, torch.cuda.Event, torch.cuda.Event, list]] = {}

    def submit(self, job: TransferJob) -> None:
        stream = self._streams[self._next]
        self._next = (self._next + 1) % len(self._streams)
        start = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        tier = self.tier
        chunks = job.chunks
        bad: list[int] = []
        if job.is_store:
            # The blocks were written by work queued on the compute stream: wait for it.
            stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(stream):
                start.record(stream)
                copy_blocks(
                    self.kv_cache, tier.blocks, [b for c in chunks for b in c.block_ids],
                    _tier_ids(tier, chunks), non_blocking=True,
                )  # fmt: skip
                done.record(stream)
        else:
            ok = tier.verify([c.slot for c in chunks], [c.key for c in chunks])
            bad = [i for i, g in enumerate(ok) if not g]
            good = [c for c, g in zip(chunks, ok, strict=True) if g]
            with torch.cuda.stream(stream):
                start.record(stream)
                if good:
                    copy_blocks(
                        tier.blocks, self.kv_cache, _tier_ids(tier, good),
                        [b for c in good for b in c.block_ids], non_blocking=True,
                    )  # fmt: skip
                done.record(stream)
        self._inflight[job.job_id] = (job, start, done, bad)

    def _complete(self, job_id: int) -> TransferResult:
        job, start, done, bad = self._inflight.pop(job_id)
        if job.is_store:
            self.tier.record([c.slot for c in job.chunks], [c.key for c in job.chunks])
        nblocks = sum(len(c.block_ids) for i, c in enumerate(job.chunks) if i not in bad)
        return TransferResult(
            job_id,
            ok=not bad,
            bad_chunks=bad,
            nbytes=nblocks * self.tier.layout.block_bytes,
            seconds=start.elapsed_time(done) / 1000.0,
        )

    def poll(self) -> list[TransferResult]:
        done_ids = [jid for jid, (_, _, done, _) in self._inflight.items() if done.query()]
        return [self._complete(jid) for jid in done_ids]

    def has_results(self) -> bool:
        return any(done.query() for _, _, done, _ in self._inflight.values())

    def wait(self, job_ids: Iterable[int]) -> None:
        for jid in job_ids:
            entry = self._inflight.get(jid)
            if entry is not None:
                entry[2].synchronize()

    def wait_any(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:
            if any(done.query() for _, _, done, _ in self._inflight.values()):
                return
            time.sleep(5e-5)

    def shutdown(self) -> None:
        for _, _, done, _ in self._inflight.values():
            done.synchronize()


def _int32(n: int) -> int:
    """``n`` wrapped to a signed 32-bit int (the gate's forward count)."""
    return (n + (1 << 31)) % (1 << 32) - (1 << 31)


def make_transfer_worker(kv_cache: torch.Tensor, tier: CpuBackend) -> TransferWorker:
    """The worker for ``kv_cache``'s device."""
    kind = kv_cache.device.type
    if kind == "cpu":
        return CpuTransferWorker(kv_cache, tier)
    if kind == "cuda":
        return CudaTransferWorker(kv_cache, tier)
    raise ValueError(f"KV offloading does not support {kind} KV caches")
