"""Batched block copies between two block tensors (the primary pool and a host tier).

Both tensors are ``[num_blocks, *block_shape]`` with one contiguous block per row. A list of
(source block, destination block) pairs becomes one slice ``copy_`` per maximal run where both
sides are consecutive: every copy is a memcpy of whole blocks (64 KiB to MiBs each), so the
per-call cost (a few microseconds) stays small against the copy itself. Measured on this
project's CPU machine, a loop of block ``copy_`` was consistently faster than the indexing kernels
(``index_put_``, ``index_select(out=)``, ``index_copy_``) for scattered 64-384 KiB blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs covering the pairs, in destination order."""
    if len(src_ids) != len(dst_ids):
        raise ValueError("src_ids and dst_ids differ in length")
    pairs = sorted(zip(dst_ids, src_ids, strict=True))
    runs: list[tuple[int, int, int]] = []
    for d, s in pairs:
        if runs:
            s0, d0, n = runs[-1]
            if d == d0 + n and s == s0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
            if d < d0 + n:
                raise ValueError(f"destination block {d} appears twice")
        runs.append((s, d, 1))
    return runs


def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    *,
    non_blocking: bool = False,
) -> int:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every i; returns the bytes copied."""
    for s, d, n in block_runs(src_ids, dst_ids):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)
    return len(src_ids) * src[0].numel() * src.element_size()
