"""Host-memory tier: exact size, clear errors, slots, headers and verification."""

from __future__ import annotations

import pytest
import torch

from kvserve.kv.backends import create_backend
from kvserve.kv.backends.base import ChunkHeader, ChunkLayout
from kvserve.kv.backends.checksum import (
    block_checksums,
    chunk_checksum,
    piece_starts,
    slot_checksums,
)
from kvserve.kv.backends.cpu import CpuBackend

LAYOUT = ChunkLayout(
    num_layers=3, block_size=16, num_kv_heads=2, head_dim=32, dtype="bfloat16", blocks_per_chunk=2
)


def test_layout_from_kv_cache() -> None:
    kv = torch.zeros(5, 3, 2, 16, 2, 32, dtype=torch.bfloat16)
    lay = ChunkLayout.from_kv_cache(kv, blocks_per_chunk=2)
    assert lay == LAYOUT
    assert lay.block_bytes == 3 * 2 * 16 * 2 * 32 * 2
    assert lay.chunk_bytes == 2 * lay.block_bytes and lay.chunk_tokens == 32
    assert "bfloat16" in lay.describe() and "k2" in lay.describe()
    with pytest.raises(ValueError, match="kv_cache must be"):
        ChunkLayout.from_kv_cache(torch.zeros(5, 3, 16, 2, 32))
    with pytest.raises(ValueError, match="contiguous"):
        ChunkLayout.from_kv_cache(kv.transpose(3, 4))


@pytest.mark.parametrize("extra", [0, 1, LAYOUT.chunk_bytes - 1])
def test_exact_size_no_rounding(extra: int) -> None:
    n = 37  # not a power of two
    tier = create_backend("cpu", LAYOUT, n * LAYOUT.chunk_bytes + extra)
    assert isinstance(tier, CpuBackend)
    assert tier.num_slots == n
    assert tier.nbytes == n * LAYOUT.chunk_bytes == tier.capacity_bytes
    assert tier.blocks.shape == (n * 2, 3, 2, 16, 2, 32)
    assert tier.blocks.dtype == torch.bfloat16
    assert not tier.pinned  # no CUDA here


def test_too_small_and_too_large_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="smaller than one offload chunk"):
        CpuBackend(LAYOUT, LAYOUT.chunk_bytes - 1)
    with pytest.raises(MemoryError, match="cannot allocate the KV offload tier"):
        CpuBackend(LAYOUT, 1 << 50)  # 1 PiB
    with pytest.raises(ValueError, match="unknown KV backend"):
        create_backend("tape", LAYOUT, 1 << 20)


def test_slot_allocation_and_double_free() -> None:
    tier = CpuBackend(LAYOUT, 4 * LAYOUT.chunk_bytes)
    assert tier.allocate_slots(3) == [0, 1, 2] and tier.num_free_slots() == 1
    with pytest.raises(RuntimeError):
        tier.allocate_slots(2)
    tier.free_slots([1])
    with pytest.raises(RuntimeError, match="freed twice"):
        tier.free_slots([1])
    assert sorted(tier.allocate_slots(2)) == [1, 3]


def test_headers_checksums_and_verification() -> None:
    tier = CpuBackend(LAYOUT, 4 * LAYOUT.chunk_bytes)
    assert tier.allocate_slots(4) == [0, 1, 2, 3]
    torch.manual_seed(0)
    data = torch.randn(2, *LAYOUT.block_shape).to(torch.bfloat16)
    tier.write_chunk(1, data, ChunkHeader(key=b"k1", checksum=0))
    h = tier.header(1)
    assert h.key == b"k1" and h.layout == LAYOUT.describe()
    assert h.checksum == chunk_checksum(data, LAYOUT.blocks_per_chunk)
    # Batched checksums agree with the single-chunk form.
    assert slot_checksums(tier.slots_u8, [1], LAYOUT.blocks_per_chunk) == [h.checksum]
    out = torch.empty_like(data)
    assert tier.read_chunk(1, out) == h and torch.equal(out, data)
    assert tier.verify([1, 1], [b"k1", b"other"]) == [True, False]
    assert tier.read_chunk(0, out) is None  # empty slot
    # Corrupt a sampled region: verification fails, read returns nothing.
    tier.chunk_view(1).view(-1)[:64] = 7.0  # covers the first sampled piece
    assert tier.verify([1], [b"k1"]) == [False]
    assert tier.read_chunk(1, out) is None
    # A chunk copied into the wrong slot does not verify as the right key.
    tier.write_chunk(2, data, ChunkHeader(key=b"k2", checksum=0))
    tier.blocks[6:8].copy_(torch.zeros_like(data))  # slot 3 content, header unset
    tier.set_header(3, b"k2", h.checksum)
    assert tier.verify([2, 3], [b"k2", b"k2"]) == [True, False]
    tier.free_slots([2])
    assert tier.header(2) is None
    tier.close()


@pytest.mark.parametrize("blocks_per_chunk", [1, 3, 5, 7, 16])
def test_checksum_samples_every_block_and_sees_any_sampled_word(blocks_per_chunk: int) -> None:
    """Each block of a chunk is sampled (also when 8 pieces do not divide evenly among the
    blocks), and changing any one 64-bit word of a sampled line changes the checksum."""
    block_bytes = 4096
    chunk_bytes = block_bytes * blocks_per_chunk
    starts = piece_starts(chunk_bytes, blocks_per_chunk)
    assert len(starts) >= 8 and all(a % 64 == 0 and a + 64 <= chunk_bytes for a in starts)
    assert {a // block_bytes for a in starts} == set(range(blocks_per_chunk))
    torch.manual_seed(blocks_per_chunk)
    chunk = torch.randint(0, 2**31, (chunk_bytes // 8,), dtype=torch.int64)
    base = chunk_checksum(chunk, blocks_per_chunk)
    for a in starts:
        for w in range(8):
            changed = chunk.clone()
            changed[a // 8 + w] += 1 << (w * 7)
            assert chunk_checksum(changed, blocks_per_chunk) != base, (a, w)


def test_checksum_of_a_small_ragged_chunk_covers_its_last_bytes() -> None:
    """A chunk hashed whole whose size is not a multiple of 8: its tail bytes count too, and
    the batched form agrees with the single-chunk one."""
    rows = torch.arange(3 * 20, dtype=torch.uint8).view(3, 20)  # 20 bytes: 2 words + 4 bytes
    base = chunk_checksum(rows[1])
    changed = rows[1].clone()
    changed[-1] += 1
    assert chunk_checksum(changed) != base
    assert slot_checksums(rows, [1, 2]) == [base, chunk_checksum(rows[2])]


@pytest.mark.parametrize(
    ("block_bytes", "blocks_per_chunk"), [(4096, 1), (4096, 3), (4096, 16), (64, 2), (24, 2)]
)
def test_checksum_of_source_blocks_equals_checksum_of_the_slot(
    block_bytes: int, blocks_per_chunk: int
) -> None:
    """A store records checksums computed from the primary pool's blocks (scattered, any
    order); they equal the checksums of the slots the blocks are copied into, large chunks
    (sampled) and small ones (hashed whole) alike. Ragged blocks and partial chunks: None."""
    torch.manual_seed(block_bytes + blocks_per_chunk)
    pool = torch.randint(0, 256, (40, block_bytes), dtype=torch.uint8)
    chunks = [[7, 3, 30, 12, 5, 9, 1, 2, 8, 11, 13, 14, 15, 16, 17, 18][:blocks_per_chunk],
              list(range(20, 20 + blocks_per_chunk))]  # fmt: skip
    slots = torch.stack([pool[c].reshape(-1) for c in chunks])
    got = block_checksums(pool, chunks, blocks_per_chunk)
    if block_bytes % 8:
        assert got is None
        return
    assert got == slot_checksums(slots, [0, 1], blocks_per_chunk)
    assert block_checksums(pool, [chunks[0][:-1] or [0, 0]], blocks_per_chunk) is None
