"""OffloadingManager on a real host tier: states, pinning, in-flight protection, events."""

from __future__ import annotations

import pytest
import torch

from kvserve.kv.backends.base import ChunkLayout
from kvserve.kv.backends.cpu import CpuBackend
from kvserve.kv.events import MEDIUM_CPU, BlockRemoved, BlockStored
from kvserve.kv.offload.manager import ChunkMeta, LookupState, OffloadingManager

LAYOUT = ChunkLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32")


def make(n_slots: int = 4, policy: str = "lru") -> OffloadingManager:
    tier = CpuBackend(LAYOUT, n_slots * LAYOUT.chunk_bytes)
    assert tier.num_slots == n_slots
    return OffloadingManager(tier, policy, block_size=4)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def meta(i: int) -> ChunkMeta:
    return ChunkMeta(block_hashes=[i], parent_block_hash=i - 1 if i else None, token_ids=[i] * 4)


def store(m: OffloadingManager, ids, success=True):
    out = m.prepare_store([key(i) for i in ids], [meta(i) for i in ids])
    if out is not None:
        m.complete_store(out.keys_to_store, success)
    return out


def test_store_lookup_load_cycle() -> None:
    m = make()
    assert m.lookup([key(0)]) == 0 and m.state(key(0)) is LookupState.MISS
    out = m.prepare_store([key(0), key(1)])
    assert out.keys_to_store == [key(0), key(1)] and out.slots == [0, 1] and not out.evicted_keys
    # In flight: present but not readable.
    assert m.state(key(0)) is LookupState.HIT_PENDING and m.ref_count(key(0)) == -1
    assert m.lookup([key(0), key(1)]) == 0
    m.complete_store([key(0)])
    assert m.lookup([key(0), key(1)]) == 1
    m.complete_store([key(1)])
    assert m.lookup([key(0), key(1), key(2), key(1)]) == 2
    spec = m.prepare_load([key(0), key(1)])
    assert spec.slots == [0, 1] and m.ref_count(key(0)) == 1
    m.prepare_load([key(0)])  # a second reader: no convoy, both load
    assert m.ref_count(key(0)) == 2
    m.complete_load([key(0), key(1)])
    m.complete_load([key(0)])
    assert m.ref_count(key(0)) == 0
    with pytest.raises(RuntimeError):
        m.complete_load([key(0)])
    with pytest.raises(KeyError):
        m.prepare_load([key(3)])
    # Storing held keys again is a no-op.
    again = m.prepare_store([key(0), key(1)])
    assert again.keys_to_store == [] and again.slots == []


def test_lru_eviction_order_and_events() -> None:
    m = make(3)
    store(m, [0, 1, 2])
    m.touch([key(0)])  # order now 1, 2, 0
    out = store(m, [3, 4])
    assert out.evicted_keys == [key(1), key(2)]
    assert sorted(out.slots) == [1, 2]
    assert m.lookup([key(0)]) == 1 and m.state(key(1)) is LookupState.MISS
    ev = m.take_events()
    stored = [e for e in ev if isinstance(e, BlockStored)]
    removed = [e for e in ev if isinstance(e, BlockRemoved)]
    # Chunks continuing each other's chain are one event (0-1-2, then 3-4).
    assert [e.block_hashes for e in stored] == [[0, 1, 2], [3, 4]]
    assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == 2
    assert stored[0].token_ids == [0] * 4 + [1] * 4 + [2] * 4
    assert all(e.medium == MEDIUM_CPU and e.block_size == 4 for e in stored)
    assert [e.block_hashes for e in removed] == [[1], [2]]
    assert removed[0].medium == MEDIUM_CPU
    assert m.take_events() == []


def test_pinned_and_in_flight_chunks_are_never_evicted() -> None:
    m = make(3)
    store(m, [0, 1])
    m.prepare_load([key(0)])  # pinned reader
    inflight = m.prepare_store([key(2)])  # store in flight
    assert inflight.slots == [2]
    # Only key 1 is evictable: one new key fits, the rest is rejected.
    out = m.prepare_store([key(3), key(4)])
    assert out.keys_to_store == [key(3)] and out.evicted_keys == [key(1)]
    assert m.stats.allocation_failures == 1 and m.stats.rejected == 1
    # Nothing evictable at all -> None.
    assert m.prepare_store([key(5)]) is None
    assert m.state(key(0)) is LookupState.HIT and m.ref_count(key(2)) == -1
    m.complete_load([key(0)])
    m.complete_store([key(2)])
    assert m.prepare_store([key(5)]).evicted_keys == [key(0)]


def test_keys_of_the_same_call_are_protected() -> None:
    m = make(2)
    store(m, [0, 1])
    # key 0 is the first chunk of this very sequence: evicting it for key 2 would be useless.
    out = m.prepare_store([key(0), key(2)])
    assert out.keys_to_store == [key(2)] and out.evicted_keys == [key(1)]


def test_failed_store_frees_the_slot_silently() -> None:
    m = make(2)
    out = m.prepare_store([key(0)], [meta(0)])
    m.complete_store(out.keys_to_store, success=False)
    assert m.state(key(0)) is LookupState.MISS and m.backend.num_free_slots() == 2
    assert m.take_events() == []
    assert m.stats.store_failed == 1
    with pytest.raises(RuntimeError):
        m.complete_store([key(0)])


def test_remove_invalid_waits_for_readers() -> None:
    m = make(2)
    store(m, [0, 1])
    m.take_events()
    m.prepare_load([key(0)])
    m.remove([key(0), key(1)])
    assert m.lookup([key(0)]) == 0 and m.lookup([key(1)]) == 0
    assert m.backend.num_free_slots() == 1  # key 0 still read
    m.complete_load([key(0)])
    assert m.backend.num_free_slots() == 2 and m.num_chunks == 0
    assert sorted(e.block_hashes[0] for e in m.take_events()) == [0, 1]


def test_arc_manager_keeps_reused_chunks_over_a_scan() -> None:
    m = make(4, "arc")
    store(m, [0, 1])
    m.prepare_load([key(0), key(1)])  # reused -> frequent list
    m.complete_load([key(0), key(1)])
    store(m, [10, 11])
    # A scan of one-off chunks evicts other one-off chunks, not the reused prefix.
    for i in range(20, 30):
        store(m, [i])
    assert m.lookup([key(0), key(1)]) == 2
    m_lru = make(4, "lru")
    store(m_lru, [0, 1])
    m_lru.prepare_load([key(0), key(1)])
    m_lru.complete_load([key(0), key(1)])
    for i in range(20, 30):
        store(m_lru, [i])
    assert m_lru.lookup([key(0)]) == 0


def test_tier_usage_and_clear() -> None:
    m = make(4)
    store(m, [0, 1])
    assert m.usage == 0.5 and m.capacity == 4
    m.prepare_load([key(0)])
    m.clear()
    assert m.num_chunks == 1 and m.lookup([key(0)]) == 1
    assert isinstance(m.backend.blocks, torch.Tensor)
