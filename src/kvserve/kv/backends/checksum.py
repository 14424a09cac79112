"""Cheap chunk checksums: a multiply-sum hash of sampled cache lines of the chunk's bytes.

Hashing a whole chunk runs at about half of memcpy speed on the CPU, which would halve offload
bandwidth. Instead ``max(8, blocks per chunk)`` cache lines (64 bytes), spread over the whole
chunk at varying in-region positions, are sampled: every engine block of the chunk is, ~1 KiB
is read per 16-block chunk. The hash of those words is ``sum(word[i] * M[i]) mod 2**64`` with
fixed random odd multipliers ``M``, computed for a whole batch of chunks in a few numpy calls
(no per-chunk Python: a batch of 256 chunks costs ~0.1 ms plus the cache misses). Any change
of one sampled word changes the sum (the multipliers are odd, so invertible mod 2**64);
unrelated contents collide with probability ~2**-64.

That catches what actually goes wrong with slots (a chunk in the wrong slot, a slot reused
under a reader, a partial or missing write, down to one missing block); it does not catch a
single flipped bit outside the sampled lines. The key is compared exactly, beside the checksum.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

NUM_PIECES = 8
PIECE_BYTES = 64
_WORDS_PER_PIECE = PIECE_BYTES // 8
_SEED = 0x6B7673657276  # fixed: checksums must agree across processes and instances


@lru_cache(maxsize=16)
def piece_starts(chunk_bytes: int, blocks_per_chunk: int = 1) -> tuple[int, ...]:
    """Start offsets (cache-line aligned) of the sampled pieces in a chunk of ``chunk_bytes``
    bytes: the same number in each of its ``blocks_per_chunk`` blocks, ``NUM_PIECES`` at
    least, one per stretch of the block, at a varying place in it; ``(0,)`` when the chunk is
    small enough to hash whole."""
    per_block = -(-NUM_PIECES // blocks_per_chunk)
    block_lines = chunk_bytes // PIECE_BYTES // blocks_per_chunk
    stride = block_lines // per_block
    if stride < 2:
        return (0,)
    return tuple(
        (j * block_lines + p * stride + ((j * per_block + p) * 1031) % stride) * PIECE_BYTES
        for j in range(blocks_per_chunk)
        for p in range(per_block)
    )


@lru_cache(maxsize=16)
def _word_index(chunk_bytes: int, blocks_per_chunk: int) -> np.ndarray:
    """Indices of the sampled 64-bit words in a chunk seen as ``uint64``."""
    starts = piece_starts(chunk_bytes, blocks_per_chunk)
    if len(starts) == 1:
        return np.arange(-(-chunk_bytes // 8))  # a ragged tail is one zero-padded word
    return (np.asarray(starts)[:, None] // 8 + np.arange(_WORDS_PER_PIECE)).reshape(-1)


@lru_cache(maxsize=16)
def _multipliers(n: int) -> np.ndarray:
    rng = np.random.default_rng(_SEED)
    return rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False) | np.uint64(1)


def _as_words(table: np.ndarray) -> np.ndarray:
    """``[rows, bytes]`` uint8 as ``[rows, words]`` uint64, zero-padding a ragged tail."""
    if table.shape[1] % 8:
        pad = np.zeros((table.shape[0], 8 - table.shape[1] % 8), np.uint8)
        table = np.concatenate([table, pad], axis=1)
    return table.view(np.uint64)


def _hash_rows(words: np.ndarray, rows: np.ndarray, widx: np.ndarray) -> list[int]:
    """Checksums of ``words[rows]`` (``[rows, words]`` uint64), sampled at ``widx``."""
    return _hash_sampled(words, rows[:, None] * words.shape[1] + widx[None, :])


def _hash_sampled(words: np.ndarray, flat: np.ndarray) -> list[int]:
    """One checksum per row of ``flat``: indices of its sampled words in ``words`` flattened
    (one gather: 3x cheaper than 2-D indexing)."""
    sampled = words.reshape(-1).take(flat)
    with np.errstate(over="ignore"):
        return (sampled * _multipliers(flat.shape[1])).sum(axis=1, dtype=np.uint64).tolist()


def sampled_words(chunk_bytes: int, blocks_per_chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The int64 indices of a chunk's sampled words (the chunk seen as uint64) and their
    uint64 multipliers: what a native hash of the same checksum needs (``_stream_copy``)."""
    widx = np.ascontiguousarray(_word_index(chunk_bytes, blocks_per_chunk), dtype=np.int64)
    return widx, np.ascontiguousarray(_multipliers(len(widx)))


def chunk_checksum(chunk: torch.Tensor, blocks_per_chunk: int = 1) -> int:
    """Checksum of one contiguous host chunk (any shape)."""
    row = chunk.reshape(1, -1).view(torch.uint8).numpy()
    widx = _word_index(row.shape[1], blocks_per_chunk)
    return _hash_rows(_as_words(row), np.zeros(1, np.intp), widx)[0]


def slot_checksums(
    slots_u8: torch.Tensor, slots: Sequence[int], blocks_per_chunk: int = 1
) -> list[int]:
    """Checksums of many chunks at once; ``slots_u8`` is the tier as ``[num_slots,
    chunk_bytes]`` (equal to :func:`chunk_checksum` of each slot)."""
    if not slots:
        return []
    table = slots_u8.numpy()
    widx = _word_index(table.shape[1], blocks_per_chunk)
    if table.shape[1] % 8:
        table = table[np.asarray(slots)]
        rows = np.arange(len(slots))
    else:
        rows = np.asarray(slots, dtype=np.intp)
    return _hash_rows(_as_words(table), rows, widx)


def block_checksums(
    blocks_u8: torch.Tensor, chunk_block_ids: Sequence[Sequence[int]], blocks_per_chunk: int
) -> list[int] | None:
    """Checksums of chunks not yet in a slot: chunk ``i`` is made of the blocks
    ``chunk_block_ids[i]`` (``blocks_per_chunk`` each) of ``blocks_u8``, the primary pool as
    ``[num_blocks, block_bytes]``. Equal to :func:`slot_checksums` of the slots they are copied
    to. A store records these (the bytes it meant to write, read where they are still warm)
    rather than re-reading the slots it wrote. None when a block's size is not a multiple of 8
    bytes (a sampled word could straddle two blocks) or a chunk is partial: hash the slots."""
    if not chunk_block_ids:
        return []
    table = blocks_u8.numpy()
    block_bytes = table.shape[1]
    if block_bytes % 8:
        return None
    if any(len(c) != blocks_per_chunk for c in chunk_block_ids):
        return None  # a partial chunk: its slot's other blocks are not in the source
    ids = np.asarray(chunk_block_ids, dtype=np.intp)
    words = table.view(np.uint64)
    block_words = words.shape[1]
    widx = _word_index(block_bytes * blocks_per_chunk, blocks_per_chunk)
    # Word w of a chunk is word w % block_words of its block w // block_words.
    return _hash_sampled(words, ids[:, widx // block_words] * block_words + widx % block_words)
