"""Transfer workers: asynchronous, batched copies between the primary pool and the host tier.

Owns transfer jobs and their execution; knows slots and block ids, never keys' meaning,
requests or eviction. A job copies whole engine blocks of a few chunks in one direction:

- store (primary -> tier): copy, then record each slot's header (key + checksum);
- load (tier -> primary): verify each chunk's header; chunks that do not verify are reported
  in ``bad_chunks`` (the caller turns them into a recompute of their blocks). The CPU worker
  verifies while its copy threads copy, so a bad chunk's bytes may reach its blocks; the CUDA
  worker verifies before it queues the copies.

On the CPU a background thread runs jobs in submission order (copies release the GIL, so they
overlap the forward pass); a step's loads or stores run as one batch, copied with streaming
stores (:mod:`block_copy`). A store copies on that one thread (it overlaps the next forward
pass and takes at most one core from it; making the forward wait for it instead was measured
no better), a load (requests wait for it) is cut into pieces that copy threads, one per core,
claim while the transfer thread verifies the chunks.
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

import torch

from kvserve.kv.backends.checksum import block_checksums
from kvserve.kv.backends.cpu import CpuBackend
from kvserve.kv.offload.block_copy import CopyThreads, copy_blocks

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
class TransferJob:
    job_id: int
    is_store: bool
    chunks: list[ChunkCopy]

    @property
    def num_blocks(self) -> int:
        return sum(len(c.block_ids) for c in self.chunks)


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

    def shutdown(self) -> None:  # noqa: B027
        pass


class CpuTransferWorker(TransferWorker):
    """One background thread; jobs run in submission order. Jobs of one direction queued back
    to back (a step's loads, a step's stores) run as one batch: one pass of Python work and
    one set of copies for all of them, so the copies are as long as the block runs allow."""

    # Largest batch, in blocks (a batch in progress cannot be cancelled).
    max_batch_blocks = 4096
    # Most threads a load copies with (host memory bandwidth is reached well before).
    max_copy_threads = 8

    def __init__(self, kv_cache: torch.Tensor, tier: CpuBackend) -> None:
        super().__init__(kv_cache, tier)
        self._kv_u8 = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)
        self._copy_threads = CopyThreads(min(torch.get_num_threads(), self.max_copy_threads))
        self._cond = threading.Condition()
        self._queue: deque[TransferJob] = deque()
        self._inflight: set[int] = set()  # submitted, result not produced yet
        self._results: list[TransferResult] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kv-offload-worker", daemon=True)
        self._thread.start()

    def submit(self, job: TransferJob) -> None:
        with self._cond:
            if self._stop:
                raise RuntimeError("transfer worker is shut down")
            self._inflight.add(job.job_id)
            self._queue.append(job)
            self._cond.notify_all()

    def poll(self) -> list[TransferResult]:
        with self._cond:
            out, self._results = self._results, []
        return out

    def has_results(self) -> bool:
        return bool(self._results)

    def wait(self, job_ids: Iterable[int]) -> None:
        ids = set(job_ids)
        with self._cond:
            self._cond.wait_for(lambda: not (ids & self._inflight))

    def wait_any(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._results or not self._inflight, timeout)

    def cancel(self, job_ids: Iterable[int]) -> set[int]:
        ids = set(job_ids)
        with self._cond:
            dropped = [j for j in self._queue if j.job_id in ids]
            for job in dropped:
                self._queue.remove(job)
                self._finish(TransferResult(job.job_id, ok=False, cancelled=True))
        return {j.job_id for j in dropped}

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            for job in self._queue:
                self._finish(TransferResult(job.job_id, ok=False, cancelled=True))
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self._copy_threads.shutdown()

    def _finish(self, result: TransferResult) -> None:
        """Publish a result; the caller holds ``_cond``."""
        self._inflight.discard(result.job_id)
        self._results.append(result)
        self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if self._stop and not self._queue:
                    return
                batch = [self._queue.popleft()]
                blocks = batch[0].num_blocks
                while (
                    self._queue
                    and self._queue[0].is_store == batch[0].is_store
                    and blocks < self.max_batch_blocks
                ):
                    batch.append(self._queue.popleft())
                    blocks += batch[-1].num_blocks
            results = self._run_safe(batch)
            with self._cond:
                for result in results:
                    self._finish(result)

    def _run_safe(self, batch: list[TransferJob]) -> list[TransferResult]:
        """Run a batch; if it fails, each job alone, so that one bad job fails only itself."""
        try:
            return self._run(batch)
        except Exception:  # a failed copy must not kill the worker or the request
            if len(batch) > 1:
                return [r for job in batch for r in self._run_safe([job])]
            job = batch[0]
            logger.exception("KV transfer job %d failed", job.job_id)
            return [TransferResult(job.job_id, ok=False, bad_chunks=list(range(len(job.chunks))))]

    def _run(self, batch: list[TransferJob]) -> list[TransferResult]:
        """Jobs of one direction as one transfer: one verification or header pass, one
        :func:`copy_blocks` (runs merge across jobs). Each job is charged its share of the
        batch's time, by bytes."""
        t0 = time.perf_counter()
        tier = self.tier
        chunks = [c for job in batch for c in job.chunks]
        if batch[0].is_store:
            copy_blocks(
                self.kv_cache, tier.blocks, [b for c in chunks for b in c.block_ids],
                _tier_ids(tier, chunks),
            )  # fmt: skip
            # Checksums of the source: a copy that went wrong fails the load's verification.
            sums = block_checksums(
                self._kv_u8, [c.block_ids for c in chunks], tier.layout.blocks_per_chunk
            )
            tier.record([c.slot for c in chunks], [c.key for c in chunks], sums)
            good = [True] * len(chunks)
        else:
            # Every chunk is copied while this thread verifies them (the copy threads do not
            # wait for it): a chunk that fails is reported bad, and the connector has its blocks
            # and the request's later ones recomputed, so its copied bytes are never read.
            good: list[bool] = []
            copy_blocks(
                tier.blocks, self.kv_cache, _tier_ids(tier, chunks),
                [b for c in chunks for b in c.block_ids], threads=self._copy_threads,
                alongside=lambda: good.extend(
                    tier.verify([c.slot for c in chunks], [c.key for c in chunks])
                ),
            )  # fmt: skip
        seconds = time.perf_counter() - t0
        block_bytes = tier.layout.block_bytes
        total = sum(len(c.block_ids) for c, g in zip(chunks, good, strict=True) if g)
        results, i = [], 0
        for job in batch:
            ok = good[i : i + len(job.chunks)]
            i += len(job.chunks)
            bad = [j for j, g in enumerate(ok) if not g]
            blocks = sum(len(c.block_ids) for c, g in zip(job.chunks, ok, strict=True) if g)
            share = blocks / total if total else 1.0 / len(batch)
            results.append(
                TransferResult(job.job_id, not bad, bad, blocks * block_bytes, seconds * share)
            )
        return results


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


def make_transfer_worker(kv_cache: torch.Tensor, tier: CpuBackend) -> TransferWorker:
    """The worker for ``kv_cache``'s device."""
    kind = kv_cache.device.type
    if kind == "cpu":
        return CpuTransferWorker(kv_cache, tier)
    if kind == "cuda":
        return CudaTransferWorker(kv_cache, tier)
    raise ValueError(f"KV offloading does not support {kind} KV caches")
