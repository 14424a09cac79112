"""Batched block copies between two block tensors (the primary pool and a host tier).

Both tensors are ``[num_blocks, *block_shape]`` with one contiguous block per row. A list of
(source block, destination block) pairs becomes one copy per maximal run where both sides are
consecutive: one copy of whole blocks (64 KiB to MiBs each), so the per-copy cost stays small
against the copy itself. Host-to-host runs become byte segments copied by the native
``_stream_copy.copy_segments`` (streaming stores, no GIL; see its source for the measurements)
or, where it was not built, by numpy's memcpy. torch's per-call overhead on a block (a parallel
region even for 64 KiB) and its indexing kernels (``index_put_``, ``index_select(out=)``,
``index_copy_``) were all measured slower than either on this project's 2-core CPU machine.

With :class:`CopyThreads` (loads: a request waits for them) a host-to-host copy is cut into
pieces that one thread per core claims until none are left. torch's threaded ``copy_`` per run
was the earlier way; called from the transfer thread it starts an OpenMP team that competes
with the engine thread's, and a load of ~50 runs per 64 MiB (the primary pool's LRU blocks in
steady state) measured 3.1-4.1 GB/s that way vs 4.5-6.4 GB/s split by bytes with numpy (torch's
copy of one buffer: ~8.5). Stores copy on one thread, so that they take one core at most from
the forward pass they overlap.

A store's copy is gated by the engine's forward passes (:class:`ForwardGate`): a native thread
(:meth:`ForwardGate.lane`) copies it piece by piece while no forward pass runs, waiting on the
gate without the GIL (see ``_stream_copy.c`` for why a wait in Python cannot use the gaps).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from threading import Lock

import numpy as np
import torch

try:
    from kvserve.kv.offload import _stream_copy as _native
    from kvserve.kv.offload._stream_copy import copy_segments as _native_copy_segments
except ImportError:  # built without a C compiler (setup.py marks the extension optional)
    _native = _native_copy_segments = None

# Whether host copies use the native streaming-store copier (else numpy's memcpy).
NATIVE = _native_copy_segments is not None

# Smallest copy split across threads: below it, handing a range to another thread costs more
# than the second core gains.
PARALLEL_MIN_BYTES = 1 << 20
# Most bytes a copy thread claims at a time: small enough that the threads finish together
# (one starts late, or first verifies the load), large enough to keep each copy long.
PIECE_BYTES = 4 << 20

Segment = tuple[int, int, int]  # (source byte offset, destination byte offset, bytes)

_claim_lock = Lock()  # the numpy fallback's claims of pieces


class CopyThreads:
    """``num_threads`` copiers: the calling thread and ``num_threads - 1`` pooled ones."""

    def __init__(self, num_threads: int) -> None:
        if num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        self.num_threads = num_threads
        self._pool = (
            ThreadPoolExecutor(num_threads - 1, thread_name_prefix="kv-copy")
            if num_threads > 1
            else None
        )

    def copy(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        segments: list[Segment],
        alongside: Callable[[], None] | None = None,
    ) -> None:
        """Copy byte ``segments`` of flat ``src`` into flat ``dst``. The threads claim pieces
        of at most ``PIECE_BYTES`` from a shared cursor, so they finish together; the calling
        thread first runs ``alongside`` (a load's verification) while the others copy."""
        total = sum(n for _, _, n in segments)
        if self._pool is None or total < PARALLEL_MIN_BYTES:
            if alongside is not None:
                alongside()
            _copy_segments(src, dst, segments)
            return
        parts = split_segments(segments, max(self.num_threads, -(-total // PIECE_BYTES)))
        pieces = np.asarray([p for part in parts for p in part], dtype=np.int64)
        cursor = np.zeros(1, dtype=np.int64)  # next piece to claim, shared by the threads
        futures = [
            self._pool.submit(_claim_and_copy, src, dst, pieces, cursor)
            for _ in range(self.num_threads - 1)
        ]
        try:
            if alongside is not None:
                alongside()
        finally:  # even if it failed: no copy may still be running when this returns
            _claim_and_copy(src, dst, pieces, cursor)
            for f in futures:
                f.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _claim_and_copy(
    src: np.ndarray, dst: np.ndarray, pieces: np.ndarray, cursor: np.ndarray
) -> None:
    """Claim ``pieces`` (``[n, 3]`` int64 segments) one at a time through the shared
    ``cursor`` and copy them until none are left. Natively the claim is an atomic increment
    and the whole loop runs without the GIL."""
    if _native_copy_segments is not None:
        _native_copy_segments(src, dst, pieces.reshape(-1), True, cursor)
        return
    while True:
        with _claim_lock:
            k = int(cursor[0])
            cursor[0] = k + 1
        if k >= len(pieces):
            return
        _copy_segments(src, dst, [tuple(pieces[k].tolist())])


def _copy_segments(src: np.ndarray, dst: np.ndarray, segments: list[Segment]) -> None:
    """Byte ``segments`` of flat uint8 ``src`` into ``dst``, bounds-checked, GIL released."""
    if _native_copy_segments is not None:
        _native_copy_segments(src, dst, np.asarray(segments, dtype=np.int64).reshape(-1), True)
        return
    for s, d, n in segments:
        if s < 0 or d < 0 or n < 0 or s + n > src.size or d + n > dst.size:
            raise IndexError(f"segment {s}->{d} ({n} bytes) out of range")
        dst[d : d + n] = src[s : s + n]


def split_segments(segments: list[Segment], parts: int) -> list[list[Segment]]:
    """``segments`` cut into ``parts`` lists of (nearly) equal bytes, in order; a segment may
    be split between two lists."""
    total = sum(n for _, _, n in segments)
    quota = -(-total // parts)
    out: list[list[Segment]] = [[] for _ in range(parts)]
    part, room = 0, quota
    for s, d, n in segments:
        while n:
            take = min(n, room)
            out[part].append((s, d, take))
            s, d, n, room = s + take, d + take, n - take, room - take
            if room == 0 and part < parts - 1:
                part, room = part + 1, quota
    return out


def run_array(src_ids: Sequence[int], dst_ids: Sequence[int]) -> np.ndarray:
    """``[n, 3]`` int64 (src_start, dst_start, length) runs covering the pairs, in destination
    order; no Python per pair or per run (a batch has thousands of pairs)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError("src_ids and dst_ids differ in length")
    if not len(dst_ids):
        return np.empty((0, 3), dtype=np.int64)
    d = np.asarray(dst_ids, dtype=np.int64)
    s = np.asarray(src_ids, dtype=np.int64)
    dd = np.diff(d)
    if (dd <= 0).any():  # not already in destination order (a store's slots usually are)
        order = np.argsort(d, kind="stable")
        d, s = d[order], s[order]
        dd = np.diff(d)
        if (dd == 0).any():
            raise ValueError(f"destination block {int(d[1:][dd == 0][0])} appears twice")
    breaks = np.flatnonzero((dd != 1) | (np.diff(s) != 1)) + 1
    starts = np.empty(len(breaks) + 1, dtype=np.int64)
    starts[0], starts[1:] = 0, breaks
    runs = np.empty((len(starts), 3), dtype=np.int64)
    runs[:, 0], runs[:, 1] = s[starts], d[starts]
    runs[:-1, 2] = np.diff(starts)
    runs[-1, 2] = len(d) - starts[-1]
    return runs


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """:func:`run_array` as a list of ``(src_start, dst_start, length)`` tuples."""
    return [tuple(r) for r in run_array(src_ids, dst_ids).tolist()]


def _check_runs(runs: np.ndarray, n_src: int, n_dst: int) -> None:
    """Every run within both tensors (numpy and torch would silently shorten a slice)."""
    bad = (runs[:, :2] < 0).any(axis=1) | (runs[:, 0] + runs[:, 2] > n_src)
    bad |= runs[:, 1] + runs[:, 2] > n_dst
    if bad.any():
        s, d, n = runs[int(np.flatnonzero(bad)[0])].tolist()
        raise IndexError(f"block run {s}->{d} (x{n}) out of range ({n_src} -> {n_dst})")


def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    *,
    non_blocking: bool = False,
    threads: CopyThreads | None = None,
    alongside: Callable[[], None] | None = None,
    piece_bytes: int = 0,
    between_pieces: Callable[[], None] | None = None,
) -> int:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every i; returns the bytes copied.

    ``threads``: host-to-host copies are split by bytes across them (else one thread).
    ``alongside``: run on the calling thread during the copy (before it, without threads).
    ``between_pieces`` (one thread, host to host): called before each piece of at most
    ``piece_bytes`` (a store pauses there while a forward pass runs)."""
    runs = run_array(src_ids, dst_ids)
    _check_runs(runs, src.shape[0], dst.shape[0])
    if src.device.type == "cpu" and dst.device.type == "cpu":
        s_np, d_np = as_byte_rows(src), as_byte_rows(dst)
        segments = [tuple(r) for r in (runs * s_np.shape[1]).tolist()]
        flat_src, flat_dst = s_np.reshape(-1), d_np.reshape(-1)
        if between_pieces is not None and piece_bytes > 0:
            total = sum(n for _, _, n in segments)
            for piece in split_segments(segments, max(1, -(-total // piece_bytes))):
                between_pieces()
                _copy_segments(flat_src, flat_dst, piece)
        elif threads is None:
            if alongside is not None:
                alongside()
            _copy_segments(flat_src, flat_dst, segments)
        else:
            threads.copy(flat_src, flat_dst, segments, alongside)
    else:
        if alongside is not None:
            alongside()
        for s, d, n in runs.tolist():
            dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)
    return len(src_ids) * src[0].numel() * src.element_size()


def host_segments(
    src: torch.Tensor, dst: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat byte views of two host block tensors and the ``[n, 3]`` int64 (source offset,
    destination offset, length) segments that copy ``src[src_ids[i]]`` to ``dst[dst_ids[i]]``
    (one per run, bounds-checked)."""
    runs = run_array(src_ids, dst_ids)
    _check_runs(runs, src.shape[0], dst.shape[0])
    s_np, d_np = as_byte_rows(src), as_byte_rows(dst)
    return s_np.reshape(-1), d_np.reshape(-1), runs * s_np.shape[1]


class ForwardGate:
    """Says whether the engine runs a forward pass, to copies that wait for the gaps between
    them (a :meth:`lane`'s). The engine thread calls :meth:`forward`; the owner of the copies
    sets :meth:`release` (copy at once: someone waits for them) and :meth:`yield_` (wait before
    the next piece: more urgent copies run). Native only (:data:`GATED`)."""

    _FORWARDS, _RELEASE, _YIELD = 3, 4, 5  # slots of the gate (see _stream_copy.c)

    def __init__(self) -> None:
        if _native is None:
            raise RuntimeError("ForwardGate needs the native _stream_copy extension")
        self._gate = np.zeros(8, dtype=np.int32)
        self._release = self._yield = False

    def forward(self, begins: bool) -> None:
        _native.gate_forward(self._gate, begins)

    def release(self, on: bool) -> None:
        if on != self._release:
            self._release = on
            _native.gate_set(self._gate, self._RELEASE, int(on))

    def yield_(self, on: bool) -> None:
        if on != self._yield:
            self._yield = on
            _native.gate_set(self._gate, self._YIELD, int(on))

    def lane(self, src: np.ndarray, dst: np.ndarray, piece_bytes: int):
        """A native :class:`StoreLane <_stream_copy.StoreLane>` copying store jobs from flat
        ``src`` to flat ``dst`` through this gate, ``piece_bytes`` at a time (:data:`GATED`)."""
        return _native.StoreLane(src, dst, self._gate, piece_bytes)

    @property
    def forwards(self) -> int:
        """Forward passes begun (wraps at 2**31)."""
        return int(self._gate[self._FORWARDS])


# Whether stores can copy on a native thread waiting for the gaps (:meth:`ForwardGate.lane`).
GATED = _native is not None and hasattr(_native, "StoreLane") and hasattr(_native, "plan_store")


def plan_store(
    pool: np.ndarray,
    block_bytes: int,
    blocks_per_chunk: int,
    dst_blocks: int,
    src_ids: Sequence[int],
    slots: Sequence[int],
    sampled: tuple[np.ndarray, np.ndarray],
) -> tuple[np.ndarray, list[int]]:
    """A store of whole chunks, natively: the ``[n, 3]`` byte segments that copy chunk ``c``'s
    source blocks ``src_ids[c * k:(c + 1) * k]`` of ``pool`` (the primary pool as flat bytes)
    to tier blocks ``slots[c] * k ..`` (equal to :func:`host_segments`), and each chunk's
    checksum of its source (equal to ``checksum.block_checksums``; ``sampled`` from
    ``checksum.sampled_words``). Needs :data:`GATED`."""
    segments, sums = _native.plan_store(
        pool, block_bytes, blocks_per_chunk, dst_blocks, array("q", src_ids),
        array("q", slots), *sampled,
    )  # fmt: skip
    return np.frombuffer(segments, dtype=np.int64).reshape(-1, 3), sums


def as_byte_rows(blocks: torch.Tensor) -> np.ndarray:
    """A contiguous host block tensor as a ``[num_blocks, block_bytes]`` uint8 numpy view."""
    return blocks.view(blocks.shape[0], -1).view(torch.uint8).numpy()
