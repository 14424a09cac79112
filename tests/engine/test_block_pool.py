"""Block pool: exact block ids, ref counts, free-queue (LRU) order, eviction and KV events."""

import pytest

from kvserve.engine.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvserve.engine.hashing import hash_block_tokens, hash_to_int, salt_digest
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)

BS = 4


def make_request(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), block_size=BS, **kw)


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_operations_keep_order_and_links():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks[1:])
    assert q.block_ids() == [1, 2, 3, 4, 5] and len(q) == 5
    assert q.popleft().block_id == 1
    q.remove(blocks[3])
    assert q.block_ids() == [2, 4, 5]
    q.append(blocks[3])
    q.appendleft(blocks[1])
    assert q.block_ids() == [1, 2, 4, 5, 3]
    assert ids(q.popleft_n(3)) == [1, 2, 4]
    assert q.block_ids() == [5, 3] and q.num_free_blocks == 2
    q.append_n([blocks[1], blocks[2]])
    assert q.block_ids() == [5, 3, 1, 2]
    with pytest.raises(AssertionError):
        q.append(blocks[1])  # already linked
    with pytest.raises(AssertionError):
        q.remove(blocks[4])  # not in the queue
    with pytest.raises(ValueError):
        q.popleft_n(5)
    assert ids(q.popleft_n(4)) == [5, 3, 1, 2]
    with pytest.raises(ValueError):
        q.popleft()


def test_fresh_pool_hands_out_blocks_in_id_order_never_the_null_block():
    pool = BlockPool(6, enable_caching=True, block_size=BS)
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4, 5]
    assert pool.get_num_free_blocks() == 5 and pool.get_usage() == 0.0
    got = pool.get_new_blocks(5)
    assert ids(got) == [1, 2, 3, 4, 5]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.null_block.ref_cnt == 0 and pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(reversed(got))
    pool.check_integrity()
    # Freed uncached blocks go to the head, in the order freed.
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4, 5]
    assert 0 not in ids(pool.get_new_blocks(5))


def test_tiny_pool_rejected():
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True, block_size=BS)


def test_cache_full_blocks_emits_one_stored_event_with_parent_and_tokens():
    pool = BlockPool(8, enable_caching=True, block_size=BS)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    req = make_request("a", prompt)
    h = hash_block_tokens(prompt, BS)
    assert req.block_hashes == h
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert [b.block_hash for b in blocks] == [h[0], h[1], None]
    assert pool.get_cached_block(h[0]) is blocks[0]
    assert pool.get_cached_block(h[1]) is blocks[1]
    (ev,) = pool.take_events()
    assert ev == BlockStored(
        block_hashes=[hash_to_int(h[0]), hash_to_int(h[1])],
        parent_block_hash=None,
        token_ids=prompt[:8],
        block_size=BS,
        medium="GPU",
        extra_keys=[None, None],
    )
    assert pool.take_events() == []
    # Two more tokens fill block 2: its event names block 1 as parent.
    req.append_output_token(7)
    req.append_output_token(8)
    pool.cache_full_blocks(req, blocks, 2, 3)
    (ev,) = pool.take_events()
    assert ev.block_hashes == [hash_to_int(req.block_hashes[2])]
    assert ev.parent_block_hash == hash_to_int(h[1])
    assert ev.token_ids == [108, 109, 7, 8]
    pool.check_integrity()
    # The events survive the wire format.
    batch = decode_batch(encode_batch([ev], ts=1.0))
    assert batch.events == [ev]


def test_salted_request_events_carry_extra_keys():
    pool = BlockPool(8, enable_caching=True, block_size=BS)
    prompt = list(range(8))
    req = make_request("a", prompt, cache_salt="tenant-1")
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    (ev,) = pool.take_events()
    assert ev.extra_keys == [[salt_digest("tenant-1")], None]  # never the raw salt
    assert ev.block_hashes[0] != hash_to_int(hash_block_tokens(prompt, BS)[0])
    lora = make_request("b", prompt, lora_name="adapter")
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(lora, blocks, 0, 2)
    (ev,) = pool.take_events()
    assert ev.extra_keys == [["adapter"], ["adapter"]] and ev.lora_name == "adapter"


def test_lru_eviction_order_and_removed_events():
    pool = BlockPool(6, enable_caching=True, block_size=BS)
    r1 = make_request("r1", list(range(8)))
    r2 = make_request("r2", list(range(50, 58)))
    b1 = pool.get_new_blocks(2)  # [1, 2]
    b2 = pool.get_new_blocks(2)  # [3, 4]
    pool.cache_full_blocks(r1, b1, 0, 2)
    pool.cache_full_blocks(r2, b2, 0, 2)
    pool.take_events()
    # r2 finishes first, then r1; each tail-first.
    pool.free_blocks(reversed(b2))
    pool.free_blocks(reversed(b1))
    assert pool.free_block_queue.block_ids() == [5, 4, 3, 2, 1]
    assert pool.get_num_free_blocks() == 5
    pool.check_integrity()
    # The never-used block goes first, then r2's tail, then r2's head, ... (the events say
    # so); the evicted blocks are handed out in ascending order, one run for a block table.
    got = pool.get_new_blocks(3)
    assert ids(got) == [3, 4, 5]
    (ev,) = pool.take_events()
    assert ev == BlockRemoved(
        block_hashes=[hash_to_int(r2.block_hashes[1]), hash_to_int(r2.block_hashes[0])],
        medium="GPU",
    )
    assert pool.get_cached_block(r2.block_hashes[0]) is None
    assert pool.get_cached_block(r1.block_hashes[0]) is b1[0]
    pool.check_integrity()


def test_touch_pulls_free_cached_block_out_of_queue():
    pool = BlockPool(5, enable_caching=True, block_size=BS)
    req = make_request("r", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_queue.block_ids() == [3, 4, 2, 1]
    hit = pool.get_cached_block(req.block_hashes[0])
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.free_block_queue.block_ids() == [3, 4, 2]
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.free_block_queue.block_ids() == [3, 4, 2]
    pool.free_blocks([hit])
    assert pool.free_block_queue.block_ids() == [3, 4, 2, 1]
    with pytest.raises(AssertionError):
        pool.free_blocks([hit])
    pool.check_integrity()


def test_duplicate_hashes_removed_event_only_when_last_copy_goes():
    pool = BlockPool(4, enable_caching=True, block_size=BS)
    a = make_request("a", list(range(4)))
    b = make_request("b", list(range(4)))
    ba = pool.get_new_blocks(1)
    bb = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, ba, 0, 1)
    pool.cache_full_blocks(b, bb, 0, 1)
    stored = pool.take_events()
    assert len(stored) == 2 and stored[0].block_hashes == stored[1].block_hashes
    assert len(pool.cached_block_hash_to_block[a.block_hashes[0]]) == 2
    pool.check_integrity()
    pool.free_blocks(ba)
    pool.free_blocks(bb)
    assert pool.free_block_queue.block_ids() == [3, 1, 2]
    assert ids(pool.get_new_blocks(2)) == [1, 3]  # evicts 3, then 1
    assert pool.take_events() == []  # block 2 still holds the hash
    assert pool.get_cached_block(a.block_hashes[0]) is bb[0]
    assert ids(pool.get_new_blocks(1)) == [2]
    (ev,) = pool.take_events()
    assert ev.block_hashes == [hash_to_int(a.block_hashes[0])]
    pool.check_integrity()


def test_evict_blocks_forgets_content_of_in_use_and_free_blocks():
    pool = BlockPool(5, enable_caching=True, block_size=BS)
    req = make_request("r", list(range(12)))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 3)
    pool.take_events()
    pool.free_blocks([blocks[2]])
    pool.evict_blocks([blocks[1].block_id, blocks[2].block_id, 0, 99])
    (ev,) = pool.take_events()
    assert ev.block_hashes == [hash_to_int(h) for h in req.block_hashes[1:3]]
    assert blocks[1].block_hash is None and blocks[2].block_hash is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    pool.check_integrity()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(5, enable_caching=True, block_size=BS)
    req = make_request("r", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_queue.block_ids() == [3, 4, 2, 1]  # LRU: cached blocks at the tail
    assert pool.reset_prefix_cache() is True
    # Nothing cached: back to ascending order, so that new tables are consecutive blocks.
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    pool.free_blocks(pool.blocks[3:0:-1])
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_cached_block(req.block_hashes[0]) is None
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    pool.check_integrity()


def test_caching_disabled_and_events_disabled_and_cpu_medium():
    off = BlockPool(4, enable_caching=False, block_size=BS)
    req = make_request("r", list(range(8)))
    blocks = off.get_new_blocks(2)
    off.cache_full_blocks(req, blocks, 0, 2)
    assert off.get_cached_block(req.block_hashes[0]) is None and off.take_events() == []
    quiet = BlockPool(4, enable_caching=True, block_size=BS, enable_kv_cache_events=False)
    blocks = quiet.get_new_blocks(2)
    quiet.cache_full_blocks(req, blocks, 0, 2)
    assert quiet.get_cached_block(req.block_hashes[1]) is blocks[1]
    assert quiet.take_events() == []
    cpu = BlockPool(4, enable_caching=True, block_size=BS, medium="CPU")
    blocks = cpu.get_new_blocks(2)
    cpu.cache_full_blocks(req, blocks, 0, 2)
    cpu.free_blocks(reversed(blocks))
    cpu.get_new_blocks(3)
    stored, removed = cpu.take_events()
    assert stored.medium == "CPU" and removed.medium == "CPU"


def test_check_integrity_catches_corruption():
    pool = BlockPool(5, enable_caching=True, block_size=BS)
    req = make_request("r", list(range(4)))
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [blk], 0, 1)
    pool.check_integrity()
    pool.blocks[3].ref_cnt = 1  # referenced yet free
    with pytest.raises(AssertionError, match="free queue but referenced"):
        pool.check_integrity()
    pool.blocks[3].ref_cnt = 0
    pool.blocks[2].block_hash = b"x" * 32  # hash but not in the map
    with pytest.raises(AssertionError, match="not in the map"):
        pool.check_integrity()
    pool.blocks[2].block_hash = None
    blk.ref_cnt = 0  # unreferenced but not free
    with pytest.raises(AssertionError, match="not in the free queue"):
        pool.check_integrity()
    blk.ref_cnt = 1
    pool.free_block_queue.num_free_blocks += 1
    with pytest.raises(AssertionError, match="counter"):
        pool.check_integrity()
