"""Batched block copies between two block tensors (the primary pool and a host tier).

Both tensors are ``[num_blocks, *block_shape]`` with one contiguous block per row. A list of
(source block, destination block) pairs is turned into the fewest possible copies: maximal
runs where both sides are consecutive become one slice ``copy_``; a destination run fed from
scattered sources on the same device becomes one ``index_select(out=)``. No per-element Python
loop and no ``index_copy_`` (measured several times slower than a plain copy for large rows).
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
    runs = block_runs(src_ids, dst_ids)
    same_device = src.device == dst.device
    i = 0
    while i < len(runs):
        s, d, n = runs[i]
        # Single-block runs with consecutive destinations: gather them in one call.
        j = i + 1
        if same_device and n == 1:
            while j < len(runs) and runs[j][2] == 1 and runs[j][1] == d + (j - i):
                j += 1
        if j - i > 1:
            idx = torch.tensor([r[0] for r in runs[i:j]], dtype=torch.long, device=src.device)
            torch.index_select(src, 0, idx, out=dst[d : d + (j - i)])
        else:
            dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)
        i = j
    return len(src_ids) * src[0].numel() * src.element_size()
