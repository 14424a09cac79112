"""Byte access to the primary pool's KV blocks, for transports.

The pool is one contiguous ``[num_blocks, num_layers, 2, block_size, H_kv, D]`` tensor, so a
block is ``block_bytes`` contiguous bytes and a run of consecutive block ids is one contiguous
range: transports move runs, never single blocks, and never build a Python object per block on
the data path. On the CPU the pool is host memory and a run is a ``memoryview`` that sockets
send from and receive into directly.

CUDA (not exercised by the tests, which run on CPUs): device memory is not addressable by
sockets; runs go through a pinned host staging buffer (:meth:`BlockMemory.stage_out` /
:meth:`BlockMemory.stage_in`), one synchronous copy per piece.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch
import xxhash

xxh3 = xxhash.xxh3_64_intdigest

# Largest piece of a run staged through host memory at once (CUDA only).
STAGING_BYTES = 32 << 20


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(first block id, count, index of its first block in block_ids)`` per run of
    consecutive block ids, in order."""
    runs: list[tuple[int, int, int]] = []
    i, n = 0, len(block_ids)
    while i < n:
        j = i + 1
        while j < n and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        runs.append((block_ids[i], j - i, i))
        i = j
    return runs


class BlockMemory:
    """The KV pool as bytes: views of runs (CPU) or staged copies of them (CUDA)."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        if not kv_cache.is_contiguous():
            raise ValueError("the KV pool must be contiguous")
        self.kv_cache = kv_cache
        self.num_blocks = int(kv_cache.shape[0])
        self.block_bytes = int(kv_cache[0].numel() * kv_cache.element_size())
        self.is_cuda = kv_cache.is_cuda
        flat = kv_cache.view(-1).view(torch.uint8)
        self._flat = flat
        self._mv: memoryview | None = None
        if not self.is_cuda:
            self._mv = memoryview(flat.numpy())
        self._staging_lock = threading.Lock()
        self._seal_staging: torch.Tensor | None = None

    # -- CPU: direct views ------------------------------------------------------------------
    def view(self, block_id: int, count: int) -> memoryview:
        """Writable bytes of blocks ``block_id .. block_id + count - 1`` (CPU pools only)."""
        if self._mv is None:
            raise RuntimeError("device memory has no host view: use stage_out / stage_in")
        if block_id < 0 or count < 0 or block_id + count > self.num_blocks:
            raise IndexError(f"blocks {block_id}+{count} outside the pool ({self.num_blocks})")
        b = self.block_bytes
        return self._mv[block_id * b : (block_id + count) * b]

    # -- CUDA: staged through pinned host memory -------------------------------------------
    def staging_buffer(self) -> torch.Tensor:
        """A pinned host buffer of whole blocks, at most :data:`STAGING_BYTES` (CUDA)."""
        n = max(1, STAGING_BYTES // self.block_bytes) * self.block_bytes
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def stage_out(self, block_id: int, count: int, staging: torch.Tensor) -> Iterator[memoryview]:
        """CUDA: the run's bytes, piece by piece, copied into ``staging`` (each piece valid
        until the next is produced)."""
        per = staging.numel() // self.block_bytes
        host = memoryview(staging.numpy())
        b = self.block_bytes
        done = 0
        while done < count:
            n = min(per, count - done)
            lo = (block_id + done) * b
            staging[: n * b].copy_(self._flat[lo : lo + n * b])  # synchronous D2H
            yield host[: n * b]
            done += n

    def stage_in(self, block_id: int, staging: torch.Tensor, nbytes: int) -> None:
        """CUDA: copy ``nbytes`` received into ``staging`` to the blocks from ``block_id`` on
        (synchronous H2D)."""
        lo = block_id * self.block_bytes
        self._flat[lo : lo + nbytes].copy_(staging[:nbytes])

    # -- digests ------------------------------------------------------------------------------
    def digests(self, block_ids: list[int]) -> list[int]:
        """xxh3-64 of each block (the GIL is released while hashing)."""
        b = self.block_bytes
        out: list[int] = []
        if not self.is_cuda:
            for first, count, _ in block_runs(block_ids):
                mv = self.view(first, count)
                out.extend(xxh3(mv[i * b : (i + 1) * b]) for i in range(count))
            return out
        # CUDA: through a staging buffer (one extra device-to-host copy per sealed block).
        with self._staging_lock:
            if self._seal_staging is None:
                self._seal_staging = self.staging_buffer()
            staging = self._seal_staging
            for first, count, _ in block_runs(block_ids):
                for piece in self.stage_out(first, count, staging):
                    k = len(piece) // b
                    out.extend(xxh3(piece[i * b : (i + 1) * b]) for i in range(k))
        return out


def verify_blocks(data: memoryview, block_bytes: int, digests: list[int], first: int) -> int:
    """How many leading blocks of ``data`` match ``digests[first:]``."""
    b = block_bytes
    n = len(data) // b
    for i in range(n):
        if xxh3(data[i * b : (i + 1) * b]) != digests[first + i]:
            return i
    return n
