"""What every KV tier backend is: a fixed number of chunk slots, with a header per chunk.

Owns :class:`ChunkLayout` (the shape and byte size of one offload chunk, derived from the
primary pool's ``kv_cache`` layout), :class:`ChunkHeader` (what is checked when a chunk is read
back) and the :class:`Backend` interface. Slot allocation lives here too (a free list) so that
policies and managers never touch storage. Backends know nothing of requests or eviction.

A chunk is ``blocks_per_chunk`` consecutive engine blocks of one sequence, each block holding
all layers (``[num_layers, 2, block_size, num_kv_heads, head_dim]``), stored back to back.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

# Bump when the chunk byte layout or the header's meaning changes.
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ChunkLayout:
    """Shape of one chunk: ``blocks_per_chunk`` blocks in the primary pool's block layout."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    blocks_per_chunk: int = 1

    @classmethod
    def from_kv_cache(cls, kv_cache: torch.Tensor, blocks_per_chunk: int = 1) -> ChunkLayout:
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(
                "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_dim], got {tuple(kv_cache.shape)}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous (one block = one contiguous chunk)")
        _, layers, _, block_size, heads, head_dim = kv_cache.shape
        return cls(
            num_layers=int(layers),
            block_size=int(block_size),
            num_kv_heads=int(heads),
            head_dim=int(head_dim),
            dtype=str(kv_cache.dtype).removeprefix("torch."),
            blocks_per_chunk=int(blocks_per_chunk),
        )

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def element_size(self) -> int:
        import torch

        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.element_size

    @property
    def chunk_bytes(self) -> int:
        return self.block_bytes * self.blocks_per_chunk

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    def describe(self) -> str:
        """A stable string naming the layout (part of every chunk's identity check)."""
        return (
            f"v{FORMAT_VERSION}:L{self.num_layers}:kv2:bs{self.block_size}:H{self.num_kv_heads}"
            f":D{self.head_dim}:{self.dtype}:k{self.blocks_per_chunk}"
        )


def model_fingerprint(*parts: str) -> str:
    """A short digest naming the model and hash seed whose KV a tier holds."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ChunkHeader:
    """Identity of one stored chunk. A read whose header does not match is a miss."""

    key: bytes  # block hash of the chunk's last block
    checksum: int  # see kv/offload/checksum.py
    layout: str = ""  # ChunkLayout.describe()
    model: str = ""  # model_fingerprint(...)
    version: int = FORMAT_VERSION


class Backend(ABC):
    """A tier of ``num_slots`` fixed-size chunk slots.

    The offloading manager allocates slots here and maps keys to them; the transfer worker
    moves data. Every backend supports :meth:`write_chunk`/:meth:`read_chunk` of one chunk
    from/to a host tensor (lower tiers are staged through host memory); the host-memory
    backend also exposes its storage tensor for batched copies with the primary pool.
    """

    name: ClassVar[str]
    medium: ClassVar[str]  # KV event medium ("CPU", "DISK", ...)

    def __init__(self, layout: ChunkLayout, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a backend needs at least one slot")
        self.layout = layout
        self.num_slots = num_slots
        # (slot, stamp) in the order slots were freed. An entry is stale once its slot was
        # taken by extension (see allocate_slots) or freed again (a newer stamp): skipped when
        # popped. _is_free is the truth, _stamp[slot] the stamp of its last free.
        self._free: deque[tuple[int, int]] = deque((s, 0) for s in range(num_slots))
        self._is_free = [True] * num_slots
        self._stamp = [0] * num_slots
        self._num_free = num_slots

    # -- slots ----------------------------------------------------------------------------
    def num_free_slots(self) -> int:
        return self._num_free

    def allocate_slots(self, n: int) -> list[int]:
        """``n`` slots, in ascending order (consecutive chunks in consecutive slots: one copy
        for a run of them). The slot free the longest comes first (first freed, first reused),
        then the free slots right after it, before the next slot free the longest: chunks
        evicted together were stored together, so a request's chunks stay in one run of slots
        instead of being split further at each generation of reuse."""
        if n > self._num_free:
            raise RuntimeError(f"{n} slots requested, {self._num_free} free")
        out: list[int] = []
        is_free, stamp = self._is_free, self._stamp
        while len(out) < n:
            s, st = self._free.popleft()
            if not is_free[s] or stamp[s] != st:
                continue  # stale
            while s < self.num_slots and is_free[s] and len(out) < n:
                is_free[s] = False
                out.append(s)
                s += 1
        self._num_free -= n
        if len(self._free) > 2 * self.num_slots:  # too many stale entries: drop them
            self._free = deque(e for e in self._free if is_free[e[0]] and stamp[e[0]] == e[1])
        return sorted(out)

    def free_slots(self, slots: Iterable[int]) -> None:
        for s in slots:
            if self._is_free[s]:
                raise RuntimeError(f"slot {s} freed twice")
            self._is_free[s] = True
            self._stamp[s] += 1
            self._free.append((s, self._stamp[s]))
            self._num_free += 1

    # -- data -----------------------------------------------------------------------------
    @abstractmethod
    def write_chunk(self, slot: int, data: torch.Tensor, header: ChunkHeader) -> None:
        """Store one chunk (``[blocks_per_chunk, *block_shape]``) and its header in ``slot``."""

    @abstractmethod
    def read_chunk(self, slot: int, out: torch.Tensor) -> ChunkHeader | None:
        """Copy the chunk in ``slot`` into ``out``; its header, or None if the slot is empty."""

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.layout.chunk_bytes

    def close(self) -> None:  # noqa: B027
        """Release storage."""
