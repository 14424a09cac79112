"""Cheap chunk checksums: CRC-32 of the chunk key and of sampled pieces of the chunk's bytes.

A full CRC-32 runs at about half of memcpy speed on the CPU, which would halve offload
bandwidth. Instead 64 pieces of 16 bytes, spread over the whole chunk (every layer's K and V
region gets some) at varying in-region positions, are hashed: ~1 KiB read per chunk, a few
percent of the copy's memory traffic. That catches what actually goes wrong with slots (a
chunk in the wrong slot, a slot reused under a reader, a partial or missing write); it does
not catch a single flipped bit. The key, layout and model checks are exact.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from functools import lru_cache

import torch

NUM_PIECES = 64
PIECE_BYTES = 16


@lru_cache(maxsize=16)
def sample_offsets(chunk_bytes: int) -> torch.Tensor:
    """Byte offsets sampled in a chunk of ``chunk_bytes`` bytes (same for every chunk)."""
    if chunk_bytes <= NUM_PIECES * PIECE_BYTES:
        return torch.arange(chunk_bytes, dtype=torch.long)
    stride = chunk_bytes // NUM_PIECES
    room = stride - PIECE_BYTES
    starts = [i * stride + (i * 1031) % room for i in range(NUM_PIECES)]
    base = torch.tensor(starts, dtype=torch.long)
    return (base[:, None] + torch.arange(PIECE_BYTES, dtype=torch.long)[None, :]).reshape(-1)


def chunk_checksum(chunk: torch.Tensor, key: bytes) -> int:
    """Checksum of one contiguous host chunk (any shape) stored under ``key``."""
    flat = chunk.reshape(-1).view(torch.uint8)
    sample = flat.take(sample_offsets(flat.numel()))
    return zlib.crc32(sample.numpy(), zlib.crc32(key))


def slot_checksums(
    slots_u8: torch.Tensor, slots: Sequence[int], keys: Sequence[bytes]
) -> list[int]:
    """Checksums of many chunks at once; ``slots_u8`` is the tier as ``[num_slots, bytes]``."""
    if not slots:
        return []
    chunk_bytes = slots_u8.shape[1]
    starts = torch.tensor(list(slots), dtype=torch.long).mul_(chunk_bytes)
    rows = slots_u8.view(-1).take(starts[:, None] + sample_offsets(chunk_bytes)[None, :])
    rows = rows.numpy()
    return [zlib.crc32(rows[i], zlib.crc32(k)) for i, k in enumerate(keys)]
