"""The native streaming-store copier: same bytes as numpy's copy, at any alignment and length,
bounds checked before anything is written; and the numpy fallback where it is not built."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.offload import block_copy
from kvserve.kv.offload.block_copy import copy_blocks

try:
    from kvserve.kv.offload import _stream_copy as native
except ImportError:  # the install test below fails then; the others are skipped
    native = None
needs_native = pytest.mark.skipif(native is None, reason="the C extension was not built")

BUF = 1 << 20  # large enough for segments on the streaming path (>= 64 KiB)


def test_the_install_built_the_native_copier() -> None:
    # setup.py marks the extension optional; scripts/setup.sh installs with a compiler, so a
    # silently failed build would show up here rather than as a slower offload tier.
    assert block_copy.NATIVE


def reference(src: np.ndarray, dst: np.ndarray, segments) -> np.ndarray:
    out = dst.copy()
    for s, d, n in segments:
        out[d : d + n] = src[s : s + n]
    return out


@st.composite
def segment_lists(draw):
    """Up to 6 segments with disjoint destinations, any alignment, 0 bytes to 300 KiB."""
    segments, taken = [], []
    for _ in range(draw(st.integers(0, 6))):
        n = draw(st.one_of(st.integers(0, 200), st.integers(64 << 10, 300 << 10)))
        s = draw(st.integers(0, BUF - n))
        d = draw(st.integers(0, BUF - n))
        if any(d < e and b < d + n for b, e in taken):
            continue
        taken.append((d, d + n))
        segments.append((s, d, n))
    return segments


@needs_native
@settings(max_examples=60, deadline=None)
@given(segments=segment_lists(), nontemporal=st.booleans())
def test_matches_numpy_at_any_alignment(segments, nontemporal) -> None:
    rng = np.random.default_rng(len(segments))
    src = rng.integers(0, 256, BUF, dtype=np.uint8)
    dst = rng.integers(0, 256, BUF, dtype=np.uint8)
    want = reference(src, dst, segments)
    native.copy_segments(src, dst, np.asarray(segments, np.int64).reshape(-1), nontemporal)
    assert np.array_equal(dst, want)


@needs_native
@pytest.mark.parametrize("num_threads", [1, 2, 4])
def test_threads_sharing_a_cursor_copy_each_segment_once(num_threads: int) -> None:
    """Each thread claims segments through the shared cursor until none are left."""
    rng = np.random.default_rng(num_threads)
    src = rng.integers(0, 256, BUF, dtype=np.uint8)
    dst = np.zeros(BUF, np.uint8)
    lengths = rng.integers(1, 16_000, 60)  # 0.5 MB in all
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    segments = [(int(a), int(BUF - a - n), int(n)) for a, n in zip(starts, lengths, strict=True)]
    want = reference(src, dst, segments)
    flat, cursor = np.asarray(segments, np.int64).reshape(-1), np.zeros(1, np.int64)
    threads = [
        threading.Thread(target=native.copy_segments, args=(src, dst, flat, True, cursor))
        for _ in range(num_threads)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert np.array_equal(dst, want)
    assert cursor[0] == len(segments) + num_threads  # one failed claim per thread
    dst[:] = 0
    native.copy_segments(src, dst, flat, True, np.full(1, -3, np.int64))  # nothing to claim
    native.copy_segments(src, dst, flat, True, np.full(1, len(segments), np.int64))
    assert not dst.any()
    with pytest.raises(ValueError, match="cursor"):
        native.copy_segments(src, dst, flat, True, np.zeros(1, np.int32))


@needs_native
def test_rejects_bad_segments_before_copying() -> None:
    src = np.arange(4096, dtype=np.uint64).view(np.uint8)
    dst = np.zeros(1024, np.uint8)
    size = src.size
    bad = [(size - 10, 0, 11), (0, 1020, 5), (-1, 0, 1), (0, -8, 4), (0, 0, -1)]
    for segment in bad:
        # A good segment first: nothing may be written when a later one is out of range.
        segments = np.asarray([(0, 0, 512), segment], np.int64).reshape(-1)
        with pytest.raises(IndexError, match="out of range"):
            native.copy_segments(src, dst, segments, True)
        assert not dst.any()
    with pytest.raises(ValueError, match="triples"):
        native.copy_segments(src, dst, np.zeros(4, np.int64), True)
    read_only = np.zeros(1024, np.uint8)
    read_only.flags.writeable = False
    with pytest.raises((TypeError, BufferError)):
        native.copy_segments(src, read_only, np.zeros(3, np.int64), True)


@needs_native
def test_numpy_fallback_copies_the_same_blocks(monkeypatch) -> None:
    """Where the extension is not built, copy_blocks uses numpy: same result, same checks."""
    g = torch.Generator().manual_seed(0)
    src = torch.randn(16, 2, 64, 160, generator=g)  # 80 KiB blocks: the streaming path
    src_ids, dst_ids = [3, 4, 5, 0, 9, 12], [1, 2, 3, 10, 7, 6]
    got = torch.zeros_like(src)
    copy_blocks(src, got, src_ids, dst_ids)
    monkeypatch.setattr(block_copy, "_native_copy_segments", None)
    fallback = torch.zeros_like(src)
    copy_blocks(src, fallback, src_ids, dst_ids)
    assert torch.equal(got, fallback)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(got[d], src[s])
    with pytest.raises(IndexError, match="out of range"):
        flat = got.view(-1).view(torch.uint8).numpy()
        block_copy._copy_segments(flat, flat, [(0, 0, -1)])
    # The fallback's threads claim pieces under a lock: same bytes.
    monkeypatch.setattr(block_copy, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(block_copy, "PIECE_BYTES", 10_000)
    threads = block_copy.CopyThreads(3)
    try:
        threaded = torch.zeros_like(src)
        copy_blocks(src, threaded, src_ids, dst_ids, threads=threads)
    finally:
        threads.shutdown()
    assert torch.equal(threaded, got)


# ---------------------------------------------- the store lane: copies gated by forward passes
FAR_NS = 30 * 10**9  # a deadline far away: only the gate lets a piece through
SLOT_FORWARDS, SLOT_RELEASE, SLOT_YIELD = 3, 4, 5  # gate slots (see _stream_copy.c)


def lane_for(src, dst, piece=64 << 10):
    gate = np.zeros(8, np.int32)
    return native.StoreLane(src, dst, gate, piece), gate


def submit(lane, job_id, segments, max_forward=1 << 30, deadline_ns=None) -> None:
    deadline_ns = time.monotonic_ns() + FAR_NS if deadline_ns is None else deadline_ns
    lane.submit(job_id, np.asarray(segments, np.int64).reshape(-1), max_forward, deadline_ns)


def ids(*job_ids: int) -> np.ndarray:
    return np.asarray(job_ids, np.int64)


@needs_native
@settings(max_examples=40, deadline=None)
@given(jobs=st.lists(segment_lists(), min_size=1, max_size=3), piece=st.integers(1, 200 << 10))
def test_lane_copies_match_numpy(jobs, piece) -> None:
    """Jobs copied in a gap, in pieces of any size, one after another: the same bytes as plain
    copies in submission order, each job reported once, in order."""
    rng = np.random.default_rng(len(jobs))
    src = rng.integers(0, 256, BUF, dtype=np.uint8)
    dst = rng.integers(0, 256, BUF, dtype=np.uint8)
    want = dst
    for segments in jobs:
        want = reference(src, want, segments)
    lane, _ = lane_for(src, dst, piece)
    try:
        for i, segments in enumerate(jobs):
            submit(lane, i, segments)
        assert lane.wait(ids(*range(len(jobs))), 30.0)
        done = lane.take_done()
        assert [d[0] for d in done] == list(range(len(jobs))) and lane.pending == 0
        assert all(in_forward == 0 for _, in_forward, _, _ in done)  # no forward pass ran
        assert np.array_equal(dst, want)
    finally:
        lane.close()


@needs_native
def test_lane_waits_for_the_gap_yields_to_loads_and_copies_when_released() -> None:
    src = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    segments = [(0, 4 << 20, 3 << 20), (5 << 20, 0, 1 << 20)]
    want = reference(src, np.zeros_like(src), segments)
    lane, gate = lane_for(src, dst)
    try:
        native.gate_forward(gate, True)
        submit(lane, 1, segments)
        assert not lane.wait(ids(1), 0.1) and not dst.any()  # waits while the forward runs
        assert lane.pending == 1 and not lane.has_done and lane.take_done() == []
        native.gate_forward(gate, False)  # the gap: copied at once
        assert lane.wait(ids(1), 10.0) and np.array_equal(dst, want)
        ((job, in_forward, cpu, wall),) = lane.take_done()
        assert job == 1 and in_forward == 0 and cpu > 0 and wall > 0

        dst[:] = 0
        native.gate_set(gate, SLOT_YIELD, 1)  # loads copy: even in a gap, the store waits
        submit(lane, 2, segments)
        assert not lane.wait(ids(2), 0.1) and not dst.any()
        native.gate_forward(gate, True)
        native.gate_set(gate, SLOT_YIELD, 0)
        native.gate_set(gate, SLOT_RELEASE, 1)  # released: copies in the forward, counted so
        assert lane.wait(ids(2), 10.0) and np.array_equal(dst, want)
        ((job, in_forward, _, _),) = lane.take_done()
        assert job == 2 and in_forward > 0
        native.gate_set(gate, SLOT_RELEASE, 0)

        forwards = int(gate[SLOT_FORWARDS])
        submit(lane, 3, segments, max_forward=forwards - 1)  # lagging: copies in the forward
        submit(lane, 4, segments, deadline_ns=time.monotonic_ns() - 1)  # past its deadline
        assert lane.wait(ids(3, 4), 10.0)
        assert [d[0] for d in lane.take_done()] == [3, 4]
        with pytest.raises(ValueError, match="cannot be set"):
            native.gate_set(gate, 0, 1)  # the sequence word is the gate's own
    finally:
        native.gate_forward(gate, False)
        lane.close()


@needs_native
def test_lane_cancels_queued_jobs_and_wakes_wait_any() -> None:
    src, dst = np.ones(4 << 20, np.uint8), np.zeros(4 << 20, np.uint8)
    lane, gate = lane_for(src, dst)
    try:
        lane.wait_any(10.0)  # nothing pending: returns at once
        native.gate_forward(gate, True)
        for j in range(3):
            submit(lane, j, [(0, j << 20, 1 << 20)])
        time.sleep(0.05)  # job 0 is taken and waits at the gate; 1 and 2 are queued
        assert sorted(lane.cancel(ids(0, 2, 9))) == [2] and lane.pending == 2
        t = time.monotonic()
        lane.wait_any(0.05)  # nothing ends while the forward runs: the timeout
        assert time.monotonic() - t >= 0.04 and not lane.has_done
        threading.Timer(0.05, native.gate_forward, (gate, False)).start()
        lane.wait_any(30.0)  # wakes when job 0 ends
        assert lane.has_done
        assert lane.wait(ids(0, 1), 10.0)
        assert [d[0] for d in lane.take_done()] == [0, 1]
        assert dst[: 2 << 20].all() and not dst[2 << 20 :].any()  # job 2 never copied
    finally:
        native.gate_forward(gate, False)
        lane.close()
    with pytest.raises(RuntimeError, match="not running"):
        submit(lane, 5, [(0, 0, 1)])


@needs_native
def test_lane_checks_every_segment_before_queueing() -> None:
    src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    lane, _ = lane_for(src, dst)
    try:
        with pytest.raises(IndexError, match="out of range"):
            submit(lane, 0, [(0, 0, 4096), (0, (1 << 20) - 10, 11)])
        with pytest.raises(ValueError, match="triples"):
            lane.submit(0, np.zeros(4, np.int64), 0, 0)
        assert lane.pending == 0 and not dst.any()
    finally:
        lane.close()
    with pytest.raises(ValueError, match="gate"):
        native.StoreLane(src, dst, np.zeros(4, np.int32), 1 << 16)
    with pytest.raises(TypeError):
        native.StoreLane(src, np.ones(8, np.uint8).tobytes(), np.zeros(8, np.int32), 1 << 16)


@needs_native
@settings(max_examples=80, deadline=None)
@given(
    k=st.integers(1, 4),
    block_words=st.sampled_from([2, 8, 40, 512]),
    data=st.data(),
)
def test_plan_store_matches_segments_and_checksums(k, block_words, data) -> None:
    """The native store plan: the same runs as host_segments and the same checksums as
    block_checksums, for chunks in any slot order; bad slots and blocks are refused."""
    from kvserve.kv.backends.checksum import block_checksums, sampled_words
    from kvserve.kv.offload.block_copy import host_segments, plan_store

    num_blocks, num_slots = 24, 10
    pool = torch.from_numpy(
        np.random.default_rng(block_words).integers(0, 2**62, (num_blocks, block_words))
    )
    tier = torch.zeros(num_slots * k, block_words, dtype=torch.int64)
    n = data.draw(st.integers(0, num_slots))
    slots = data.draw(st.permutations(range(num_slots)))[:n]
    src = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=n * k, max_size=n * k))
    bb = block_words * 8
    pool_u8 = pool.view(torch.uint8).reshape(num_blocks, bb)
    sampled = sampled_words(bb * k, k)
    segments, sums = plan_store(pool_u8.numpy().reshape(-1), bb, k, num_slots * k, src, slots,
                                sampled)  # fmt: skip
    dst = [s * k + j for s in slots for j in range(k)]
    assert segments.tolist() == host_segments(pool, tier, src, dst)[2].tolist()
    chunk_ids = [src[c * k : (c + 1) * k] for c in range(n)]
    assert sums == block_checksums(pool_u8, chunk_ids, k)
    if n:
        with pytest.raises(ValueError, match="twice"):
            plan_store(pool_u8.numpy().reshape(-1), bb, k, num_slots * k, src + src[:k],
                       slots + slots[:1], sampled)  # fmt: skip
        with pytest.raises(IndexError):
            plan_store(pool_u8.numpy().reshape(-1), bb, k, num_slots * k, src,
                       [num_slots] + slots[1:], sampled)  # fmt: skip
        with pytest.raises(IndexError):
            plan_store(pool_u8.numpy().reshape(-1), bb, k, num_slots * k,
                       [num_blocks] + src[1:], slots, sampled)  # fmt: skip
