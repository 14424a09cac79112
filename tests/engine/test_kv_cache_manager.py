"""KV cache manager: prefix hits, the last-token cap, tail-first frees, admission accounting,
tenant isolation, statistics, and a property test that random workloads never corrupt or leak
blocks."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), block_size=BS, **kw)


def admit(kvm: KVCacheManager, req: Request, **kw):
    """Prefix lookup + allocation for the whole prompt, as the scheduler does."""
    blocks, n_hit = kvm.get_computed_blocks(req)
    new = kvm.allocate_slots(req, req.num_tokens - n_hit, n_hit, blocks, **kw)
    if new is not None:
        req.num_computed_tokens = req.num_tokens  # the step computed everything
    return new, n_hit


def test_prefix_hit_shares_exact_blocks():
    kvm = KVCacheManager(10, BS, max_model_len=64)
    a = make_request("a", list(range(10)))
    new, hit = admit(kvm, a)
    assert hit == 0 and [b.block_id for b in new] == [1, 2, 3]
    assert kvm.get_block_ids("a") == [1, 2, 3]
    assert kvm.num_cached_block["a"] == 2  # the partial block is not cached
    b = make_request("b", list(range(8)) + [70, 71, 72])
    new, hit = admit(kvm, b)
    assert hit == 8
    assert kvm.get_block_ids("b") == [1, 2, 4] and [x.block_id for x in new] == [4]
    assert [kvm.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert kvm.get_num_common_prefix_blocks("a", 2) == 2
    kvm.check_integrity()
    s = kvm.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (2, 21, 8)


def test_last_token_cap_full_hit_drops_last_block():
    kvm = KVCacheManager(10, BS, max_model_len=64)
    prompt = list(range(12))  # exactly 3 blocks
    a = make_request("a", prompt)
    admit(kvm, a)
    assert kvm.num_cached_block["a"] == 3
    b = make_request("b", prompt)
    (blocks,), hit = kvm.get_computed_blocks(b)  # one KV cache group
    assert hit == 8 and [x.block_id for x in blocks] == [1, 2]
    # One token more and the third block is fully inside the first num_tokens - 1 tokens.
    c = make_request("c", prompt + [99])
    (blocks,), hit = kvm.get_computed_blocks(c)
    assert hit == 12 and [x.block_id for x in blocks] == [1, 2, 3]


def test_free_is_tail_first_so_prefix_outlives_tail():
    kvm = KVCacheManager(10, BS, max_model_len=64)
    a = make_request("a", list(range(10)))
    admit(kvm, a)
    assert kvm.block_pool.free_block_queue.block_ids() == [4, 5, 6, 7, 8, 9]
    kvm.free(a)
    # Uncached partial block 3 first, then the LRU order ends with the prefix head.
    assert kvm.block_pool.free_block_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert kvm.get_block_ids("a") == []
    kvm.check_integrity()
    # Still hittable after free.
    b = make_request("b", list(range(8)) + [5, 5])
    _, hit = admit(kvm, b)
    assert hit == 8 and kvm.get_block_ids("b") == [1, 2, 3]


def test_admission_counts_free_hit_blocks_against_capacity():
    kvm = KVCacheManager(5, BS, max_model_len=64)  # 4 usable blocks
    a = make_request("a", list(range(9)))
    admit(kvm, a)  # blocks 1, 2, 3; 1 and 2 cached
    kvm.free(a)  # free queue: [3, 4, 2, 1]
    hog = make_request("hog", list(range(100, 108)))
    admit(kvm, hog)  # takes 3 and 4
    assert kvm.get_block_ids("hog") == [3, 4]
    events_before = kvm.take_events()
    assert events_before  # BlockStored for a and hog
    b = make_request("b", list(range(8)) + [1, 2, 3, 4])  # 12 tokens, hits 2 free blocks
    (blocks,), hit = kvm.get_computed_blocks(b)
    assert hit == 8 and all(x.ref_cnt == 0 for x in blocks)
    # Needs 1 new block + 2 hit blocks that are free = 3 > 2 free blocks.
    assert kvm.allocate_slots(b, 4, hit, blocks) is None
    assert kvm.block_pool.free_block_queue.block_ids() == [2, 1]
    assert kvm.get_block_ids("b") == [] and kvm.take_events() == []
    kvm.check_integrity()
    # (Counting only the 1 new block against 2 free would have "fit", and popping it would
    # have evicted one of the very blocks being hit.)
    assert [b.ref_cnt for b in blocks] == [0, 0]
    assert kvm.get_computed_blocks(b)[1] == 8


def test_admission_refusal_then_success_after_free():
    kvm = KVCacheManager(5, BS, max_model_len=64)
    a = make_request("a", list(range(9)))
    admit(kvm, a)
    kvm.free(a)
    hog = make_request("hog", list(range(100, 108)))
    admit(kvm, hog)
    c = make_request("c", list(range(9)))
    blocks, hit = kvm.get_computed_blocks(c)
    assert hit == 8
    assert kvm.allocate_slots(c, 1, hit, blocks) is None  # 2 free hits + 1 new > 2 free
    assert kvm.make_prefix_cache_stats().requests == 2  # the refused lookup is not counted
    kvm.free(hog)
    blocks, hit = kvm.get_computed_blocks(c)
    new = kvm.allocate_slots(c, 1, hit, blocks)
    assert kvm.get_block_ids("c") == [1, 2, new[0].block_id]
    s = kvm.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (3, 9 + 8 + 9, 8)
    kvm.check_integrity()


def test_cache_salt_isolates_prefixes():
    kvm = KVCacheManager(16, BS, max_model_len=64)
    prompt = list(range(10))
    admit(kvm, make_request("t1", prompt, cache_salt="tenant-1"))
    assert admit(kvm, make_request("t2", prompt, cache_salt="tenant-2"))[1] == 0
    assert admit(kvm, make_request("plain", prompt))[1] == 0
    assert admit(kvm, make_request("t1b", prompt, cache_salt="tenant-1"))[1] == 8
    assert admit(kvm, make_request("plain2", prompt))[1] == 8
    kvm.check_integrity()


def test_decode_growth_caches_new_full_blocks_and_respects_max_model_len():
    kvm = KVCacheManager(10, BS, max_model_len=8)
    a = make_request("a", list(range(3)))
    admit(kvm, a)
    assert kvm.get_block_ids("a") == [1] and kvm.num_cached_block.get("a", 0) == 0
    a.append_output_token(50)  # 4 tokens: block 0 becomes full once computed
    assert kvm.allocate_slots(a, 1) == []
    assert kvm.num_cached_block["a"] == 1
    a.num_computed_tokens = 4
    a.append_output_token(51)
    new = kvm.allocate_slots(a, 1)
    assert [b.block_id for b in new] == [2]
    # Lookahead is capped at max_model_len: never more than 2 blocks.
    a.num_computed_tokens = 5
    a.append_output_token(52)
    assert kvm.allocate_slots(a, 1, num_lookahead_tokens=10) == []
    assert kvm.get_block_ids("a") == [1, 2]


def test_delay_cache_blocks_then_cache_blocks():
    kvm = KVCacheManager(10, BS, max_model_len=64)
    a = make_request("a", list(range(13)))
    new = kvm.allocate_slots(a, 0, num_external_computed_tokens=12, delay_cache_blocks=True)
    assert [b.block_id for b in new] == [1, 2, 3]
    assert kvm.get_computed_blocks(make_request("x", list(range(13))))[1] == 0
    kvm.cache_blocks(a, 12)
    assert kvm.get_computed_blocks(make_request("y", list(range(13))))[1] == 12
    kvm.uncache_from(a, 1)
    assert kvm.get_computed_blocks(make_request("z", list(range(13))))[1] == 4
    assert kvm.num_cached_block["a"] == 1
    kvm.check_integrity()


def test_bad_arguments():
    kvm = KVCacheManager(num_blocks=4, block_size=BS)
    assert kvm.max_model_len == 12
    a = make_request("a", list(range(5)))
    with pytest.raises(ValueError):
        kvm.allocate_slots(a, 0)
    blocks = kvm.block_pool.blocks[1:2]
    with pytest.raises(ValueError):
        kvm.allocate_slots(a, 1, 8, blocks)  # 8 tokens but 1 block
    with pytest.raises(ValueError):
        KVCacheManager(BlockPool(4, True, 8), BS, 64)
    with pytest.raises(ValueError):
        KVCacheManager(block_size=BS)


def test_preempted_lookup_counted_separately():
    kvm = KVCacheManager(10, BS, max_model_len=64)
    a = make_request("a", list(range(10)))
    admit(kvm, a)
    kvm.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    admit(kvm, a)
    s = kvm.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (1, 10, 0)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 10, 8)


# ---------------------------------------------------------------------------------------------
# Property test: random allocate / decode / free / abort sequences keep every invariant.

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23]]

op = st.one_of(
    st.tuples(
        st.just("add"),
        st.integers(0, len(PREFIXES) - 1),
        st.lists(st.integers(0, 3), max_size=9),
        st.booleans(),
    ),
    st.tuples(st.just("decode"), st.integers(0, 50), st.integers(0, 3)),
    st.tuples(st.just("free"), st.integers(0, 50)),
    st.tuples(st.just("chunk"), st.integers(0, 50), st.integers(1, 6)),
    st.tuples(st.just("reset")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=40), num_blocks=st.integers(3, 12))
def test_random_workload_keeps_integrity_and_never_leaks(ops, num_blocks):
    kvm = KVCacheManager(num_blocks, BS, max_model_len=40)
    live: list[Request] = []
    # Shadow of what each cached hash must mean: the prefix tokens it covers.
    n = 0
    for o in ops:
        if o[0] == "add":
            _, p, tail, salted = o
            n += 1
            req = make_request(f"r{n}", PREFIXES[p] + tail, cache_salt="s" if salted else None)
            (blocks,), hit = kvm.get_computed_blocks(req)
            assert hit < req.num_tokens and hit % BS == 0
            for i, blk in enumerate(blocks):
                assert blk.block_hash == req.block_hashes[i]
            # Chunked admission: compute part of the prompt.
            num_new = max(1, (req.num_tokens - hit) // 2)
            if kvm.allocate_slots(req, num_new, hit, blocks) is not None:
                req.num_computed_tokens = hit + num_new
                live.append(req)
        elif o[0] in ("decode", "chunk") and live:
            req = live[o[1] % len(live)]
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token(o[2] if o[0] == "decode" else 1)
            num_new = min(req.num_tokens - req.num_computed_tokens, 1 if o[0] == "decode" else o[2])
            if req.num_tokens >= 40:
                continue
            if kvm.allocate_slots(req, num_new) is not None:
                req.num_computed_tokens += num_new
            else:  # preempt (recompute later) like the scheduler would
                kvm.free(req)
                live.remove(req)
        elif o[0] == "free" and live:
            kvm.free(live.pop(o[1] % len(live)))
        elif o[0] == "reset":
            assert kvm.reset_prefix_cache() == (not live)
        kvm.check_integrity()
        for req in live:
            blocks = kvm.get_blocks(req.request_id)
            assert len(blocks) * BS >= req.num_computed_tokens
            # Every cached block of a live request holds that request's hash at that index.
            for i, blk in enumerate(blocks[: kvm.num_cached_block.get(req.request_id, 0)]):
                assert blk.block_hash == req.block_hashes[i]
    for req in live:
        kvm.free(req)
    kvm.check_integrity()
    assert kvm.get_num_free_blocks() == num_blocks - 1
    assert kvm.req_to_blocks == {} and kvm.num_cached_block == {}
