"""Cheap chunk checksums: CRC-32 of the chunk key and of sampled pieces of the chunk's bytes.

A full CRC-32 runs at about half of memcpy speed on the CPU, which would halve offload
bandwidth. Instead ``max(8, blocks per chunk)`` pieces of 64 bytes (one cache line each),
spread over the whole chunk at varying in-region positions, are hashed: every engine block of
the chunk is sampled, ~1 KiB is read per 16-block chunk, a few microseconds. That catches what
actually goes wrong with slots (a chunk in the wrong slot, a slot reused under a reader, a
partial or missing write, down to one missing block); it does not catch a single flipped bit.
The key, layout and model checks are exact.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

NUM_PIECES = 8
PIECE_BYTES = 64


@lru_cache(maxsize=16)
def piece_starts(chunk_bytes: int, blocks_per_chunk: int = 1) -> tuple[int, ...]:
    """Start offsets of the sampled pieces in a chunk of ``chunk_bytes`` bytes (at least one
    piece in each of its ``blocks_per_chunk`` blocks)."""
    num_pieces = max(NUM_PIECES, blocks_per_chunk)
    if chunk_bytes <= num_pieces * PIECE_BYTES:
        return (0,)
    stride = chunk_bytes // num_pieces
    room = stride - PIECE_BYTES
    return tuple(i * stride + (i * 1031) % room for i in range(num_pieces))


def _crc(row: np.ndarray, key: bytes, starts: tuple[int, ...], piece: int) -> int:
    crc = zlib.crc32(key)
    for a in starts:
        crc = zlib.crc32(row[a : a + piece], crc)
    return crc


def chunk_checksum(chunk: torch.Tensor, key: bytes, blocks_per_chunk: int = 1) -> int:
    """Checksum of one contiguous host chunk (any shape) stored under ``key``."""
    row = chunk.reshape(-1).view(torch.uint8).numpy()
    starts = piece_starts(row.shape[0], blocks_per_chunk)
    return _crc(row, key, starts, PIECE_BYTES if len(starts) > 1 else row.shape[0])


def slot_checksums(
    slots_u8: torch.Tensor,
    slots: Sequence[int],
    keys: Sequence[bytes],
    blocks_per_chunk: int = 1,
) -> list[int]:
    """Checksums of many chunks; ``slots_u8`` is the tier as ``[num_slots, chunk_bytes]``."""
    table = slots_u8.numpy()
    starts = piece_starts(table.shape[1], blocks_per_chunk)
    if len(starts) == 1 or not slots:
        piece = PIECE_BYTES if len(starts) > 1 else table.shape[1]
        return [_crc(table[s], k, starts, piece) for s, k in zip(slots, keys, strict=True)]
    # Gather every chunk's pieces in one numpy call; CRC-32 over the concatenated pieces equals
    # the CRC chained piece by piece (what chunk_checksum computes).
    rows = np.asarray(slots)
    sampled = np.concatenate([table[rows, a : a + PIECE_BYTES] for a in starts], axis=1)
    return [zlib.crc32(row, zlib.crc32(k)) for row, k in zip(sampled, keys, strict=True)]
