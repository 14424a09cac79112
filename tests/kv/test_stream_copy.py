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


# ------------------------------------------------------------- copies gated by forward passes
IN_FORWARD_TIMEOUT_NS = 30 * 10**9  # far away: only the gate lets a piece through


def gated(src, dst, segments, gate, start=0, piece=64 << 10, max_forward=1 << 30, deadline=None):
    deadline_ns = time.monotonic_ns() + IN_FORWARD_TIMEOUT_NS if deadline is None else deadline
    flat = np.asarray(segments, np.int64).reshape(-1)
    return native.copy_gated(src, dst, flat, gate, start, piece, max_forward, deadline_ns)


@needs_native
@settings(max_examples=60, deadline=None)
@given(segments=segment_lists(), cut=st.floats(0, 1), piece=st.integers(1, 200 << 10))
def test_gated_copy_resumed_anywhere_matches_numpy(segments, cut, piece) -> None:
    """Copied in a gap, in pieces of any size, after an earlier call stopped at any byte: the
    same bytes as one plain copy."""
    rng = np.random.default_rng(len(segments))
    src = rng.integers(0, 256, BUF, dtype=np.uint8)
    dst = rng.integers(0, 256, BUF, dtype=np.uint8)
    want = reference(src, dst, segments)
    total = sum(n for _, _, n in segments)
    start = int(cut * total)
    suffix, skip = [], start  # what is left after an earlier call copied `start` bytes
    for s, d, n in segments:
        k = min(n, skip)
        suffix.append((s + k, d + k, n - k))
        skip -= k
    resumed = dst.copy()
    gate = np.zeros(8, np.int32)  # no forward pass runs
    end, in_forward_ns = gated(src, resumed, segments, gate, start=start, piece=piece)
    assert end == total and in_forward_ns == 0
    assert np.array_equal(resumed, reference(src, dst, suffix))  # nothing before `start`
    if start == 0:
        end, _ = gated(src, dst, segments, gate, piece=piece)
        assert end == total and np.array_equal(dst, want)


@needs_native
def test_gated_copy_waits_for_the_gap_and_returns_for_more_urgent_work() -> None:
    src = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    segments = [(0, 4 << 20, 3 << 20), (5 << 20, 0, 1 << 20)]
    gate = np.zeros(8, np.int32)
    native.gate_forward(gate, True)
    out: list = []
    t = threading.Thread(target=lambda: out.append(gated(src, dst, segments, gate)))
    t.start()
    time.sleep(0.1)
    assert not out and not dst.any()  # waits while the forward pass runs
    native.gate_forward(gate, False)  # the gap: copied at once
    t.join(10)
    want = reference(src, np.zeros_like(src), segments)
    assert out == [(4 << 20, 0)] and np.array_equal(dst, want)

    dst[:] = 0
    native.gate_forward(gate, True)
    native.gate_set(gate, 5, 1)  # yield: more urgent work waits; nothing copied
    assert gated(src, dst, segments, gate) == (0, 0) and not dst.any()
    native.gate_set(gate, 5, 0)
    native.gate_set(gate, 4, 1)  # released: copies during the forward pass, counted so
    end, in_forward_ns = gated(src, dst, segments, gate)
    assert end == 4 << 20 and in_forward_ns > 0
    native.gate_set(gate, 4, 0)
    forwards = int(gate[3])
    assert gated(src, dst, segments, gate, max_forward=forwards - 1)[0] == 4 << 20  # lagging
    assert gated(src, dst, segments, gate, deadline=time.monotonic_ns() - 1)[0] == 4 << 20
    with pytest.raises(ValueError, match="cannot be set"):
        native.gate_set(gate, 0, 1)  # the sequence word is the gate's own


@needs_native
def test_gated_copy_checks_every_segment_before_copying() -> None:
    src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    gate = np.zeros(8, np.int32)
    with pytest.raises(IndexError, match="out of range"):
        gated(src, dst, [(0, 0, 4096), (0, (1 << 20) - 10, 11)], gate)
    assert not dst.any()
    with pytest.raises(ValueError, match="gate"):
        gated(src, dst, [(0, 0, 10)], np.zeros(4, np.int32))


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
