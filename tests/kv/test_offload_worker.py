"""Batched block copies and the CPU transfer worker: round trips, verification, cancel, flush."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from kvserve.kv.backends.base import ChunkLayout
from kvserve.kv.backends.cpu import CpuBackend
from kvserve.kv.offload.block_copy import CopyThreads, block_runs, copy_blocks, split_segments
from kvserve.kv.offload.worker import (
    ChunkCopy,
    CpuTransferWorker,
    TransferJob,
    WholeChunks,
    make_transfer_worker,
)

NUM_BLOCKS = 24
SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, heads, head_dim


def kv_cache(seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_BLOCKS, *SHAPE, generator=g).to(dtype)


def tier_for(kv: torch.Tensor, k: int, slots: int) -> CpuBackend:
    layout = ChunkLayout.from_kv_cache(kv, blocks_per_chunk=k)
    return CpuBackend(layout, slots * layout.chunk_bytes)


def wait_results(worker, n: int) -> list:
    out: list = []
    worker.wait([])
    for _ in range(2000):
        out += worker.poll()
        if len(out) >= n:
            return out
        threading.Event().wait(0.005)
    raise AssertionError(f"only {len(out)} of {n} results")


def hold_at_gate(worker: CpuTransferWorker, batches: list | None = None) -> threading.Event:
    """Hold the worker's thread at the returned gate before each batch it runs (so a test can
    observe the queue), recording each batch's job ids in ``batches``."""
    gate = threading.Event()
    real_run = worker._run

    def gated(batch):
        if batches is not None:
            batches.append([j.job_id for j in batch])
        gate.wait(10)
        return real_run(batch)

    worker._run = gated
    return gate


def hold_stores(worker: CpuTransferWorker) -> None:
    """Hold the worker's stores before they copy, as the engine does: a forward pass runs (and
    the lag and deadline bounds are far away). ``worker.forward_ends()`` lets them go."""
    worker.store_max_lag = 1 << 20
    worker.store_max_wait_s = 60.0
    worker.forward_begins()


# Store paths: the native lane, and the transfer thread waiting in Python (no extension).
STORE_PATHS = [pytest.param(True, id="lane"), pytest.param(False, id="python")]


def needs_lane(native: bool) -> None:
    from kvserve.kv.offload import block_copy

    if native and not block_copy.GATED:
        pytest.skip("the native extension was not built (test_stream_copy.py fails then)")


def test_block_runs() -> None:
    assert block_runs([5, 6, 7, 1], [0, 1, 2, 3]) == [(5, 0, 3), (1, 3, 1)]
    assert block_runs([3, 2, 1], [2, 1, 0]) == [(1, 0, 3)]  # sorted by destination
    assert block_runs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError, match="twice"):
        block_runs([1, 2], [4, 4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_matches_reference(dtype) -> None:
    src = kv_cache(1, dtype)
    dst = torch.zeros_like(src)
    g = torch.Generator().manual_seed(3)
    src_ids = torch.randperm(NUM_BLOCKS, generator=g)[:15].tolist()
    dst_ids = [3, 4, 5, 6, 0, 9, 8, 7, 20, 21, 23, 12, 13, 14, 16]
    nbytes = copy_blocks(src, dst, src_ids, dst_ids)
    assert nbytes == 15 * src[0].numel() * src.element_size()
    ref = torch.zeros_like(src)
    for s, d in zip(src_ids, dst_ids, strict=True):
        ref[d] = src[s]
    assert torch.equal(dst, ref)


def test_copy_blocks_rejects_bad_ids() -> None:
    src, dst = kv_cache(1), kv_cache(2)
    before = dst.clone()
    with pytest.raises(ValueError, match="twice"):
        copy_blocks(src, dst, [1, 2], [4, 4])
    for src_ids, dst_ids in [([1, NUM_BLOCKS], [4, 7]), ([1, 2], [4, NUM_BLOCKS]), ([-1], [3])]:
        with pytest.raises(IndexError, match="out of range"):
            copy_blocks(src, dst, src_ids, dst_ids)
    assert torch.equal(dst, before)  # checked before anything is copied


@pytest.mark.parametrize("seed", range(8))
def test_copy_blocks_random_patterns(seed: int) -> None:
    """Mixes of consecutive runs, gathers, scatters and fully scattered pairs."""
    rng = torch.Generator().manual_seed(seed)
    src = kv_cache(seed)
    dst = kv_cache(seed + 100)
    ref = dst.clone()
    n = int(torch.randint(1, NUM_BLOCKS, (1,), generator=rng))
    dst_ids = torch.randperm(NUM_BLOCKS, generator=rng)[:n].tolist()
    if seed % 2:
        dst_ids.sort()  # destination runs
    src_ids = torch.randperm(NUM_BLOCKS, generator=rng)[:n].tolist()
    if seed % 4 >= 2:
        src_ids.sort()  # source runs
    for s, d in zip(src_ids, dst_ids, strict=True):
        ref[d] = src[s]
    copy_blocks(src, dst, src_ids, dst_ids)
    assert torch.equal(dst, ref)


@pytest.mark.parametrize("k", [1, 3])
def test_store_zero_load_round_trip(k: int) -> None:
    kv = kv_cache(2)
    original = kv.clone()
    tier = tier_for(kv, k, slots=6)
    worker = make_transfer_worker(kv, tier)
    assert isinstance(worker, CpuTransferWorker)
    try:
        # Three chunks of k scattered primary blocks each, into slots 4, 0, 2.
        blocks = [[1 + 5 * i + j for j in range(k)] for i in range(3)]
        slots = [4, 0, 2]
        keys = [b"a", b"b", b"c"]
        worker.submit(
            TransferJob(
                1,
                True,
                [ChunkCopy(s, key, b) for s, key, b in zip(slots, keys, blocks, strict=True)],
            )
        )
        (res,) = wait_results(worker, 1)
        assert res.ok and res.job_id == 1 and res.nbytes == 3 * k * tier.layout.block_bytes
        for s, b in zip(slots, blocks, strict=True):
            assert torch.equal(tier.chunk_view(s), original[b])
        all_blocks = [x for b in blocks for x in b]
        kv[all_blocks] = 0
        # Load back into the same blocks: the primary pool is restored bit for bit.
        worker.submit(
            TransferJob(
                2,
                False,
                [ChunkCopy(s, key, b) for s, key, b in zip(slots, keys, blocks, strict=True)],
            )
        )
        (res,) = wait_results(worker, 1)
        assert res.ok and not res.bad_chunks
        assert torch.equal(kv, original)
        if k > 1:
            # Partial chunk: only the last k-1 blocks of slot 0's chunk, into fresh blocks.
            dst = [22, 23][: k - 1]
            worker.submit(TransferJob(3, False, [ChunkCopy(0, b"b", dst, offset=1)]))
            (res,) = wait_results(worker, 1)
            assert res.ok and torch.equal(kv[dst], original[blocks[1][1:]])
    finally:
        worker.shutdown()


@pytest.mark.parametrize("k", [1, 3])
def test_store_as_columns_equals_store_of_chunk_copies(k: int) -> None:
    """A store given as columns (:class:`WholeChunks`, as the connector builds it) writes the
    same bytes and headers as the same chunks given one :class:`ChunkCopy` each."""
    kv = kv_cache(7)
    blocks = [[2 + 4 * i + j for j in range(k)] for i in range(4)]
    slots, keys = [3, 0, 5, 1], [b"p", b"q", b"r", b"s"]
    tiers = []
    for columns in (False, True):
        tier = tier_for(kv, k, slots=6)
        worker = make_transfer_worker(kv, tier)
        try:
            if columns:
                chunks = WholeChunks(k)
                for s, key, b in zip(slots, keys, blocks, strict=True):
                    chunks.add(s, key, b)
                job = TransferJob(1, True, chunks)
                assert job.keys == keys and job.slots == slots and job.num_blocks == 4 * k
                assert [(c.slot, c.key, c.block_ids, c.offset) for c in job.chunks] == [
                    (s, key, b, 0) for s, key, b in zip(slots, keys, blocks, strict=True)
                ]
                job = TransferJob(1, True, chunks)  # the worker's path, not materialized
            else:
                copies = zip(slots, keys, blocks, strict=True)
                job = TransferJob(1, True, [ChunkCopy(s, key, b) for s, key, b in copies])
            worker.submit(job)
            (res,) = wait_results(worker, 1)
            assert res.ok and res.nbytes == 4 * k * tier.layout.block_bytes
            assert tier.verify(slots, keys) == [True] * 4
            tiers.append(tier)
        finally:
            worker.shutdown()
    assert torch.equal(tiers[0].blocks, tiers[1].blocks)
    for s, b in zip(slots, blocks, strict=True):
        assert torch.equal(tiers[1].chunk_view(s), kv[b])


def test_load_of_corrupt_or_wrong_chunk_is_reported() -> None:
    """Bad chunks are reported (the connector recomputes their blocks); good ones land."""
    kv = kv_cache(4)
    tier = tier_for(kv, 1, slots=4)
    worker = make_transfer_worker(kv, tier)
    try:
        worker.submit(TransferJob(1, True, [ChunkCopy(0, b"x", [1]), ChunkCopy(1, b"y", [2])]))
        wait_results(worker, 1)
        tier.blocks[1].view(-1)[:64] += 1.0  # corrupt slot 1
        before = kv.clone()
        worker.submit(
            TransferJob(
                2,
                False,
                [ChunkCopy(0, b"x", [10]), ChunkCopy(1, b"y", [11]), ChunkCopy(0, b"z", [12])],
            )
        )
        (res,) = wait_results(worker, 1)
        assert not res.ok and res.bad_chunks == [1, 2]
        assert torch.equal(kv[10], before[1])  # the good chunk was loaded
        assert res.nbytes == tier.layout.block_bytes  # only good chunks count as loaded
    finally:
        worker.shutdown()


@pytest.mark.parametrize("native", STORE_PATHS)
def test_cancel_and_flush(native: bool) -> None:
    needs_lane(native)
    kv = kv_cache(5)
    tier = tier_for(kv, 1, slots=8)
    worker = CpuTransferWorker(kv, tier, native=native)
    hold_stores(worker)
    try:
        worker.submit(TransferJob(0, True, [ChunkCopy(0, bytes([0]), [1])]))
        threading.Event().wait(0.05)  # job 0 started, waiting for the forward pass to end
        for j in range(1, 4):
            worker.submit(TransferJob(j, True, [ChunkCopy(j, bytes([j]), [j + 1])]))
        cancelled = worker.cancel([0, 2, 3, 99])
        assert cancelled == {2, 3}  # job 0 already started
        done = worker.poll()
        assert sorted(r.job_id for r in done) == [2, 3] and all(r.cancelled for r in done)
        worker.wait([0, 1])  # flush: blocks until both finished, the forward pass or not
        res = sorted(worker.poll(), key=lambda r: r.job_id)
        assert [(r.job_id, r.ok) for r in res] == [(0, True), (1, True)]
        assert torch.equal(tier.chunk_view(1)[0], kv[2])
        assert tier.header(2) is None and tier.header(3) is None  # cancelled: never written
    finally:
        worker.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(TransferJob(9, True, []))


@pytest.mark.parametrize("native", STORE_PATHS)
def test_shutdown_cancels_queued_jobs(native: bool) -> None:
    needs_lane(native)
    kv = kv_cache(6)
    tier = tier_for(kv, 1, slots=4)
    worker = CpuTransferWorker(kv, tier, native=native)
    hold_stores(worker)
    worker.submit(TransferJob(0, True, [ChunkCopy(0, b"a", [1])]))
    threading.Event().wait(0.05)  # job 0 started, waiting for the forward pass to end
    worker.submit(TransferJob(1, True, [ChunkCopy(1, b"b", [2])]))
    worker.shutdown()  # the forward pass never ends: the started store copies regardless
    res = {r.job_id: r for r in worker.poll()}
    assert res[0].ok and res[1].cancelled
    assert tier.header(0).key == b"a" and torch.equal(tier.chunk_view(0)[0], kv[1])
    assert tier.header(1) is None


def test_failed_job_reports_failure_and_worker_survives() -> None:
    kv = kv_cache(7)
    tier = tier_for(kv, 1, slots=2)
    worker = CpuTransferWorker(kv, tier)
    try:
        worker.submit(TransferJob(1, True, [ChunkCopy(5, b"bad", [1])]))  # slot out of range
        (res,) = wait_results(worker, 1)
        assert not res.ok and res.bad_chunks == [0]
        worker.submit(TransferJob(2, True, [ChunkCopy(1, b"ok", [1])]))
        (res,) = wait_results(worker, 1)
        assert res.ok
    finally:
        worker.shutdown()


def test_layout_mismatch_is_rejected() -> None:
    kv = kv_cache(8)
    other = torch.zeros(4, 2, 2, 4, 2, 16)
    tier = tier_for(other, 1, slots=2)
    with pytest.raises(ValueError, match="do not match"):
        make_transfer_worker(kv, tier)


@pytest.mark.parametrize("native", STORE_PATHS)
def test_wait_any_returns_on_a_result_or_after_the_timeout(native: bool) -> None:
    """A load held on the transfer thread, then a store held by a forward pass (which an idle
    engine's wait releases): wait_any returns when the job ends, or at the timeout."""
    needs_lane(native)
    kv = kv_cache(9)
    tier = tier_for(kv, 1, slots=4)
    tier.allocate_slots(4)
    tier.blocks[3].copy_(kv[7])
    tier.record([3], [b"hit"])
    worker = CpuTransferWorker(kv, tier, native=native)
    gate = hold_at_gate(worker)
    try:
        worker.wait_any(10)  # nothing in flight: returns at once
        worker.submit(TransferJob(0, False, [ChunkCopy(3, b"hit", [2])]))
        worker.wait_any(0.02)  # the load is held: returns after the timeout, nothing ready
        assert worker.poll() == []
        threading.Timer(0.05, gate.set).start()
        t = time.monotonic()
        worker.wait_any(30)  # wakes when the load ends, not at the timeout
        assert time.monotonic() - t < 10
        (res,) = worker.poll()
        assert res.job_id == 0 and res.ok and torch.equal(kv[2], kv[7])
        hold_stores(worker)
        worker.submit(TransferJob(1, True, [ChunkCopy(0, b"a", [1])]))
        t = time.monotonic()
        worker.wait_any(30)  # the store, released by the wait, ends
        assert time.monotonic() - t < 10
        (res,) = worker.poll()
        assert res.job_id == 1 and res.ok and torch.equal(tier.chunk_view(0)[0], kv[1])
    finally:
        gate.set()
        worker.shutdown()


def test_store_whose_copy_went_wrong_fails_the_load(monkeypatch) -> None:
    """A store records the checksum of what it meant to write (its source blocks), not of
    what landed: a copy that skipped a block is caught when the chunk is loaded."""
    from kvserve.kv.offload import worker as worker_module

    real_copy, real_segments = worker_module.copy_blocks, worker_module.host_segments

    def drops_last_block(src, dst, src_ids, dst_ids, **kw):
        return real_copy(src, dst, src_ids[:-1], dst_ids[:-1], **kw)

    def drops_last_segment_block(src, dst, src_ids, dst_ids):  # the natively gated store
        return real_segments(src, dst, src_ids[:-1], dst_ids[:-1])

    real_plan = worker_module.plan_store

    def plan_drops_last_block(pool, block_bytes, *args):  # ... of whole chunks
        segments, sums = real_plan(pool, block_bytes, *args)
        segments = segments.copy()
        segments[-1, 2] -= block_bytes
        return segments, sums

    kv = kv_cache(6)
    tier = tier_for(kv, 2, slots=4)
    worker = make_transfer_worker(kv, tier)
    try:
        monkeypatch.setattr(worker_module, "copy_blocks", drops_last_block)
        monkeypatch.setattr(worker_module, "host_segments", drops_last_segment_block)
        monkeypatch.setattr(worker_module, "plan_store", plan_drops_last_block)
        worker.submit(TransferJob(1, True, [ChunkCopy(1, b"k", [3, 4])]))
        (res,) = wait_results(worker, 1)
        assert res.ok  # the store cannot tell
        monkeypatch.setattr(worker_module, "copy_blocks", real_copy)
        worker.submit(TransferJob(2, False, [ChunkCopy(1, b"k", [10, 11])]))
        (res,) = wait_results(worker, 1)
        assert not res.ok and res.bad_chunks == [0] and res.nbytes == 0
    finally:
        worker.shutdown()


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threaded_copy_matches_reference(monkeypatch, dtype, num_threads) -> None:
    """Loads split their copies by bytes across threads: same bytes as the one-thread path,
    runs cut mid-block included."""
    from kvserve.kv.offload import block_copy

    monkeypatch.setattr(block_copy, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(block_copy, "PIECE_BYTES", 1000)  # many pieces, cut mid-block
    src = kv_cache(4, dtype)
    src_ids = [2, 3, 4, 5, 9, 10, 15, 1, 7, 8]
    dst_ids = [10, 11, 12, 13, 0, 1, 20, 5, 16, 17]  # runs of 4, 2, 1, 1, 2 blocks
    got, ref = torch.zeros_like(src), torch.zeros_like(src)
    threads = CopyThreads(num_threads)
    try:
        assert copy_blocks(src, got, src_ids, dst_ids, threads=threads) == copy_blocks(
            src, ref, src_ids, dst_ids
        )
    finally:
        threads.shutdown()
    assert torch.equal(got, ref)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(got[d], src[s])


def test_copy_runs_alongside_on_the_calling_thread_and_waits_for_the_copy(monkeypatch) -> None:
    """A load verifies on the calling thread while the copy threads copy; if that fails, the
    error surfaces only after every piece is copied (no copy outlives the call)."""
    from kvserve.kv.offload import block_copy

    monkeypatch.setattr(block_copy, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(block_copy, "PIECE_BYTES", 512)
    src = kv_cache(8)
    ids = list(range(NUM_BLOCKS))
    threads = CopyThreads(2)
    seen: list[threading.Thread] = []
    try:
        got = torch.zeros_like(src)
        copy_blocks(src, got, ids, ids, threads=threads, alongside=lambda: seen.append(
            threading.current_thread()
        ))  # fmt: skip
        assert seen == [threading.current_thread()] and torch.equal(got, src)

        def fails() -> None:
            raise RuntimeError("verification failed")

        got = torch.zeros_like(src)
        with pytest.raises(RuntimeError, match="verification failed"):
            copy_blocks(src, got, ids, ids, threads=threads, alongside=fails)
        assert torch.equal(got, src)  # the copy finished before the error was raised
    finally:
        threads.shutdown()


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_split_segments_covers_each_byte_once(parts: int) -> None:
    segments = [(0, 100, 10), (50, 0, 3), (20, 40, 25), (90, 70, 1)]
    split = split_segments(segments, parts)
    assert len(split) == parts
    sizes = [sum(n for _, _, n in p) for p in split]
    assert max(sizes) - min(sizes) <= max(1, -(-39 // parts))  # even, up to the last part
    pairs = [(s + i, d + i) for p in split for s, d, n in p for i in range(n)]
    assert pairs == [(s + i, d + i) for s, d, n in segments for i in range(n)]


SHAPE_BYTES = {
    torch.float32: 4 * torch.Size(SHAPE).numel(),
    torch.bfloat16: 2 * torch.Size(SHAPE).numel(),
}


def test_checksum_samples_every_block_of_a_large_chunk() -> None:
    """16 blocks per chunk: a chunk missing any one block's write fails verification."""
    kv = kv_cache(5)
    tier = tier_for(kv, 16, 1)
    tier.allocate_slots(1)
    tier.blocks.copy_(kv[:16])
    tier.record([0], [b"key"])
    assert tier.verify([0], [b"key"]) == [True]
    for b in range(16):
        saved = tier.blocks[b].clone()
        tier.blocks[b].zero_()  # this block's write never happened
        assert tier.verify([0], [b"key"]) == [False], b
        tier.blocks[b].copy_(saved)
    assert tier.verify([0], [b"key"]) == [True]


def test_queued_jobs_of_one_direction_run_as_one_batch() -> None:
    """Loads queued behind a running job become one batch: one _run call, results per job,
    time shared by bytes; a job that fails in the batch fails alone."""
    kv = kv_cache(10)
    tier = tier_for(kv, 2, slots=6)
    tier.allocate_slots(6)
    tier.blocks.copy_(kv[:12])
    keys = [bytes([s]) * 4 for s in range(6)]
    tier.record(list(range(6)), keys)
    dst = torch.zeros_like(kv)
    worker = CpuTransferWorker(dst, tier)
    batches: list[list[int]] = []
    gate = hold_at_gate(worker, batches)
    try:
        worker.submit(TransferJob(0, False, [ChunkCopy(0, keys[0], [1, 2])]))
        threading.Event().wait(0.05)  # job 0 runs alone, held at the gate
        worker.submit(TransferJob(1, False, [ChunkCopy(1, keys[1], [3, 4])]))
        worker.submit(
            TransferJob(2, False, [ChunkCopy(2, keys[2], [5, 6]), ChunkCopy(3, keys[3], [7, 8])])
        )
        worker.submit(TransferJob(3, False, [ChunkCopy(4, keys[4], [NUM_BLOCKS + 5, 9])]))  # bad
        worker.submit(TransferJob(4, True, [ChunkCopy(5, b"new", [10, 11])]))  # other direction
        gate.set()
        res = {r.job_id: r for r in wait_results(worker, 5)}
        # [1, 2, 3] ran as one batch; job 3's bad block failed it, so each job ran again alone.
        # The store copied on the lane, where there is one.
        assert batches == [[0], [1, 2, 3], [1], [2], [3]] + ([] if worker._lane else [[4]])
        assert res[0].ok and res[1].ok and res[2].ok and res[4].ok
        assert not res[3].ok and res[3].bad_chunks == [0]
        for s, blocks in [(0, [1, 2]), (1, [3, 4]), (2, [5, 6]), (3, [7, 8])]:
            for j, b in enumerate(blocks):
                assert torch.equal(dst[b], kv[2 * s + j])
        assert res[2].nbytes == 2 * res[1].nbytes > 0
        # A batch that succeeds charges each job its share of the time, by bytes.
        batches.clear()
        gate.clear()
        worker.submit(TransferJob(5, False, [ChunkCopy(0, keys[0], [1, 2])]))
        threading.Event().wait(0.05)
        worker.submit(TransferJob(6, False, [ChunkCopy(1, keys[1], [3, 4])]))
        worker.submit(
            TransferJob(7, False, [ChunkCopy(2, keys[2], [5, 6]), ChunkCopy(3, keys[3], [7, 8])])
        )
        gate.set()
        res = {r.job_id: r for r in wait_results(worker, 3)}
        assert batches == [[5], [6, 7]] and all(r.ok for r in res.values())
        assert res[7].seconds == pytest.approx(2 * res[6].seconds)
    finally:
        gate.set()
        worker.shutdown()


def poll_until(worker, n: int, timeout: float = 10.0) -> list:
    """Poll (without waiting in the worker, which would make stores urgent) for n results."""
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += worker.poll()
        time.sleep(0.002)
    return out


@pytest.mark.parametrize("native", STORE_PATHS)
def test_stores_wait_for_the_gap_between_forward_passes_and_loads_pass_them(
    native: bool,
) -> None:
    """A store submitted during a forward pass copies once it ends; a load submitted after
    it runs first; a store lagging more than ``store_max_lag`` passes, waited for, or behind
    too many pending store blocks copies during a forward pass (its CPU time counted so).
    Both ways of waiting: natively on the forward gate, and in Python (no extension)."""
    needs_lane(native)
    kv = kv_cache(11)
    tier = tier_for(kv, 1, slots=8)
    tier.allocate_slots(8)
    tier.blocks[5].copy_(kv[7])
    tier.record([5], [b"hit"])
    worker = CpuTransferWorker(kv, tier, native=native)
    try:
        worker.forward_begins()
        worker.submit(TransferJob(0, True, [ChunkCopy(0, b"s0", [1])]))
        worker.submit(TransferJob(1, False, [ChunkCopy(5, b"hit", [9])]))
        (res,) = poll_until(worker, 1)
        assert res.job_id == 1 and res.ok and torch.equal(kv[9], kv[7])
        assert poll_until(worker, 1, timeout=0.3) == []  # the store waits for the gap
        assert tier.header(0) is None
        worker.forward_ends()
        (res,) = poll_until(worker, 1)
        assert res.job_id == 0 and res.ok and torch.equal(tier.chunk_view(0)[0], kv[1])
        assert worker.store_cpu_s > 0 and worker.store_cpu_in_forward_s == 0

        worker.forward_begins()  # a store that lags too long copies during a forward pass
        worker.submit(TransferJob(2, True, [ChunkCopy(1, b"s1", [2])]))
        assert poll_until(worker, 1, timeout=0.2) == []
        for _ in range(worker.store_max_lag):  # forward passes begun without a gap between
            worker.forward_begins()
        assert poll_until(worker, 1, timeout=0.2) == []  # not lagging more than the bound yet
        worker.forward_begins()
        (res,) = poll_until(worker, 1)
        assert res.job_id == 2 and res.ok
        assert worker.store_cpu_in_forward_s > 0

        worker.submit(TransferJob(3, True, [ChunkCopy(2, b"s2", [3])]))  # still in forward
        worker.wait([3])  # a flush (preemption) does not wait for the gap
        assert [r.job_id for r in worker.poll()] == [3]

        worker.store_max_pending_blocks = 1  # a backlog of stores does not wait either
        worker.submit(TransferJob(4, True, [ChunkCopy(3, b"s3", [4]), ChunkCopy(4, b"s4", [5])]))
        assert [r.job_id for r in poll_until(worker, 1)] == [4]
    finally:
        worker.shutdown()


def test_a_store_completes_while_the_engine_thread_holds_the_gil() -> None:
    """The lane never takes the GIL: a store submitted by a thread that then runs pure Python
    (as the engine thread does between forward passes), with a switch interval long enough that
    a thread asking for the GIL would not get it, still ends (a transfer thread in Python would
    need the GIL to start the copy and again to publish it)."""
    needs_lane(True)
    kv = kv_cache(12)
    tier = tier_for(kv, 2, slots=4)
    worker = CpuTransferWorker(kv, tier)
    interval = sys.getswitchinterval()
    try:
        sys.setswitchinterval(30.0)
        worker.submit(TransferJob(0, True, WholeChunks(2, [3], [b"k"], [5, 6])))
        deadline = time.monotonic() + 10.0
        while not worker.has_results() and time.monotonic() < deadline:
            pass  # pure Python: the GIL is never released here
        ended = worker.has_results()
    finally:
        sys.setswitchinterval(interval)
    try:
        assert ended
        (res,) = worker.poll()
        assert res.ok and tier.header(3).key == b"k"
        assert torch.equal(tier.chunk_view(3), kv[5:7]) and tier.verify([3], [b"k"]) == [True]
    finally:
        worker.shutdown()
