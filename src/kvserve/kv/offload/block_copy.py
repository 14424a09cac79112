"""Batched block copies between two block tensors (the primary pool and a host tier).

Both tensors are ``[num_blocks, *block_shape]`` with one contiguous block per row. A list of
(source block, destination block) pairs becomes one copy per maximal run where both sides are
consecutive: a memcpy of whole blocks (64 KiB to MiBs each), so the per-copy cost stays small
against the copy itself. Host-to-host runs are copied through numpy byte views: on this
project's 2-core CPU machine, torch's per-call overhead on a block (a parallel region even for
64 KiB) and its indexing kernels (``index_put_``, ``index_select(out=)``, ``index_copy_``) were
all measured slower than that.

``parallel=True`` (loads: a request waits for them) copies runs of at least
:data:`PARALLEL_MIN_BYTES` with torch's intra-op threads instead (measured ~9 GB/s for 1 MiB
runs on 2 cores vs ~5.5 GB/s for one thread); stores stay on one thread so that they take one
core at most from the forward pass they overlap.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Smallest run copied with torch's thread pool when ``parallel``: below it the pool's start-up
# costs more than the second core gains (a 64 KiB run copies at ~3 GB/s through torch).
PARALLEL_MIN_BYTES = 512 << 10


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs covering the pairs, in destination order
    (vectorised: a batch has thousands of pairs)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError("src_ids and dst_ids differ in length")
    if not len(dst_ids):
        return []
    d = np.asarray(dst_ids, dtype=np.int64)
    order = np.argsort(d, kind="stable")
    d = d[order]
    s = np.asarray(src_ids, dtype=np.int64)[order]
    dd, ds = np.diff(d), np.diff(s)
    if (dd == 0).any():
        raise ValueError(f"destination block {int(d[1:][dd == 0][0])} appears twice")
    starts = np.concatenate(([0], np.flatnonzero((dd != 1) | (ds != 1)) + 1))
    lengths = np.diff(np.append(starts, len(d)))
    return list(zip(s[starts].tolist(), d[starts].tolist(), lengths.tolist(), strict=True))


def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    *,
    non_blocking: bool = False,
    parallel: bool = False,
) -> int:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every i; returns the bytes copied.

    ``parallel``: host-to-host runs of at least :data:`PARALLEL_MIN_BYTES` use torch's
    intra-op threads (all cores) rather than one thread."""
    runs = block_runs(src_ids, dst_ids)
    n_src, n_dst = src.shape[0], dst.shape[0]
    for s, d, n in runs:  # numpy and torch would silently shorten an out-of-range slice
        if s < 0 or d < 0 or s + n > n_src or d + n > n_dst:
            raise IndexError(f"block run {s}->{d} (x{n}) out of range ({n_src} -> {n_dst})")
    if src.device.type == "cpu" and dst.device.type == "cpu":
        # Host to host: plain byte rows, copied by numpy (a memcpy per run, no thread pool),
        # or by torch's threads for long runs of a parallel copy.
        s_np, d_np = as_byte_rows(src), as_byte_rows(dst)
        min_rows = -(-PARALLEL_MIN_BYTES // s_np.shape[1])
        for s, d, n in runs:
            if parallel and n >= min_rows:
                dst[d : d + n].copy_(src[s : s + n])  # torch: every core
            else:
                d_np[d : d + n] = s_np[s : s + n]
    else:
        for s, d, n in runs:
            dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)
    return len(src_ids) * src[0].numel() * src.element_size()


def as_byte_rows(blocks: torch.Tensor) -> np.ndarray:
    """A contiguous host block tensor as a ``[num_blocks, block_bytes]`` uint8 numpy view."""
    return blocks.view(blocks.shape[0], -1).view(torch.uint8).numpy()
