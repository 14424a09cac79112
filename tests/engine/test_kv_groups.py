"""KV cache groups (hybrid / sliding-window models): how layers are grouped, sliding groups
freeing blocks that leave the window, prefix hits every group agrees on, atomic allocation,
KV events per group, a property test of random workloads, and tiny-gemma3 (5 sliding : 1
full, window 32) HF-exact in fp32 with decodes far past the window, chunked prefill, hits
after the out-of-window blocks were freed and evicted, and preemption under a small pool."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    cdiv,
    layers_per_group,
    make_kv_cache_groups,
)
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams as Params
from kvserve.kv.events import BlockRemoved, BlockStored
from kvserve.model.config import ModelConfig
from kvserve.model.presets import make_model, model_config
from tests.engine.test_kv_cache_manager import PREFIXES, op
from tests.engine.test_llm_parity import HFOracle

BS = 4
W = 8  # window of the manager-level tests: 2 blocks


def full(*layers: int) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(layers, FullAttentionSpec())


def sliding(*layers: int, window: int = W) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(layers, SlidingWindowSpec(window))


def hybrid(num_blocks: int, num_sliding: int = 2, **kw) -> KVCacheManager:
    groups = [full(0)] + [sliding(i + 1) for i in range(num_sliding)]
    return KVCacheManager(num_blocks, BS, kv_cache_groups=groups, **kw)


def make_request(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, tokens, Params(max_tokens=8), block_size=BS, **kw)


def admit(kvm: KVCacheManager, req: Request):
    blocks, hit = kvm.get_computed_blocks(req)
    new = kvm.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return new, hit


def live_blocks(kvm: KVCacheManager, rid: str) -> list[int]:
    """Blocks (not null) each group's table holds."""
    return [sum(not b.is_null for b in m.req_to_blocks[rid]) for m in kvm.managers]


# -- grouping --------------------------------------------------------------------------------
def _config(arch: str, n: int, **kw) -> ModelConfig:
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=n, vocab_size=100)
    return ModelConfig.from_dict(dict(base, num_attention_heads=4, architectures=[arch], **kw))


def test_groups_follow_the_layer_mix():
    gemma = ModelConfig.from_dict(model_config("tiny-gemma3"))  # layer 5 full, 0-4 sliding
    groups = make_kv_cache_groups(gemma)
    assert groups == [full(5)] + [sliding(i, window=32) for i in range(5)]
    assert layers_per_group(groups) == 1
    assert make_kv_cache_groups(gemma, enable=False) == [full(0, 1, 2, 3, 4, 5)]
    mistral = _config("MistralForCausalLM", 4, sliding_window=16)
    assert make_kv_cache_groups(mistral) == [sliding(0, 1, 2, 3, window=16)]
    assert make_kv_cache_groups(mistral, enable=False) == [full(0, 1, 2, 3)]
    assert make_kv_cache_groups(_config("LlamaForCausalLM", 3)) == [full(0, 1, 2)]
    # Qwen2 with the window from layer 6 of 8: groups of 2 layers (the smaller type).
    qwen = _config(
        "Qwen2ForCausalLM", 8, sliding_window=16, use_sliding_window=True, max_window_layers=6
    )
    assert make_kv_cache_groups(qwen) == [
        full(0, 1), full(2, 3), full(4, 5), sliding(6, 7, window=16)
    ]  # fmt: skip
    # 5 full : 4 sliding are not within 1.25x: groups of 4, the last full group padded.
    qwen9 = _config(
        "Qwen2ForCausalLM", 9, sliding_window=16, use_sliding_window=True, max_window_layers=5
    )
    assert make_kv_cache_groups(qwen9) == [
        full(0, 1, 2, 3), full(4), sliding(5, 6, 7, 8, window=16)
    ]  # fmt: skip


# -- manager ---------------------------------------------------------------------------------
def test_sliding_groups_free_blocks_that_leave_the_window():
    kvm = hybrid(64)
    a = make_request("a", list(range(10)))
    admit(kvm, a)
    for step in range(60):  # decode far past the window
        a.append_output_token(100 + step)
        assert kvm.allocate_slots(a, 1) is not None
        n = a.num_computed_tokens
        full_blocks, *windows = live_blocks(kvm, "a")
        assert full_blocks == cdiv(n + 1, BS)
        # Held: from the block of the oldest key the query at n reads, to n's block.
        assert windows == [n // BS - (n - W + 1) // BS + 1 if n >= W else cdiv(n + 1, BS)] * 2
        assert max(windows) <= cdiv(W, BS) + 1
        a.num_computed_tokens += 1
        kvm.check_integrity()
    used = kvm.num_usable_blocks - kvm.get_num_free_blocks()
    assert used == sum(live_blocks(kvm, "a"))
    kvm.free(a)
    kvm.check_integrity()
    assert kvm.get_num_free_blocks() == kvm.num_usable_blocks


def test_hit_needs_the_window_in_every_sliding_group():
    kvm = hybrid(80)
    prompt = list(range(41))  # 10 full blocks + 1 token
    a = make_request("a", prompt)
    admit(kvm, a)
    kvm.free(a)
    pool = kvm.block_pool

    def cached(group: int, block: int):
        return pool.get_cached_block(a.block_hashes[block], group)

    # Every group cached all 10 blocks (the sliding ones freed 0-7 as the prefill went by,
    # all freed at the end): a full hit, the sliding groups holding only the window.
    blocks, hit = kvm.get_computed_blocks(make_request("b", prompt))
    assert hit == 40
    assert [b.block_id for b in blocks[0]] == [cached(0, i).block_id for i in range(10)]
    for g in (1, 2):  # window of the query at 40: keys [33, 40) -> blocks 8, 9
        assert [b.block_id for b in blocks[g]] == [0] * 8 + [cached(g, i).block_id for i in (8, 9)]
    # Out-of-window blocks evicted: the same hit.
    kvm.evict_blocks([cached(g, i).block_id for g in (1, 2) for i in range(6)])
    assert kvm.get_computed_blocks(make_request("c", prompt))[1] == 40
    # The full group lost block 9: 36 tokens, whose window [29, 36) is blocks 7, 8.
    kvm.evict_blocks([cached(0, 9).block_id])
    assert kvm.get_computed_blocks(make_request("d", prompt))[1] == 36
    # Group 2 lost block 8: its longest hit is 32 ([25, 32): blocks 6, 7), which group 1
    # (whose hit of 36 no longer counts) holds too.
    kvm.evict_blocks([cached(2, 8).block_id])
    blocks, hit = kvm.get_computed_blocks(make_request("e", prompt))
    assert hit == 32 and [len(b) for b in blocks] == [8, 8, 8]
    assert [b.block_id for b in blocks[1]] == [0] * 6 + [
        cached(1, 6).block_id,
        cached(1, 7).block_id,
    ]
    # Group 1 lost block 6: every shorter end needs a block evicted above: no hit at all.
    kvm.evict_blocks([cached(1, 6).block_id])
    blocks, hit = kvm.get_computed_blocks(make_request("f", prompt))
    assert hit == 0 and blocks == ([], [], [])
    kvm.check_integrity()


def test_hit_after_free_reuses_window_blocks_and_counts_them_against_capacity():
    kvm = hybrid(40)
    prompt = list(range(33))
    a = make_request("a", prompt)
    admit(kvm, a)
    kvm.free(a)
    b = make_request("b", prompt + [7, 7, 7])
    blocks, hit = kvm.get_computed_blocks(b)
    assert hit == 32
    free_before = kvm.get_num_free_blocks()
    new = kvm.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    # Hits taken: 8 full + 2 windows of 2 blocks (the null entries take nothing); new: one
    # block per group for tokens 32-35.
    assert len(new) == 3 and free_before - kvm.get_num_free_blocks() == 8 + 2 * 2 + 3
    assert live_blocks(kvm, "b") == [9, 3, 3]
    kvm.check_integrity()


def test_allocation_is_all_or_nothing_across_groups():
    kvm = hybrid(12, max_model_len=64)  # 11 usable blocks
    a = make_request("a", list(range(16)))  # 4 blocks per group = 12 > 11
    free = kvm.get_num_free_blocks()
    assert kvm.allocate_slots(a, 16) is None
    assert kvm.get_num_free_blocks() == free and "a" not in kvm.req_to_blocks
    assert all("a" not in m.req_to_blocks for m in kvm.managers)
    assert kvm.allocate_slots(a, 8) is not None  # chunked: 2 blocks per group
    a.num_computed_tokens = 8
    assert kvm.allocate_slots(a, 8) is None  # the query at 8 still reads block 0: 12 > 11
    assert live_blocks(kvm, "a") == [2, 2, 2]
    assert kvm.allocate_slots(a, 4) is not None
    a.num_computed_tokens = 12
    assert kvm.allocate_slots(a, 4) is not None  # the windows dropped block 0: 10 blocks
    assert live_blocks(kvm, "a") == [4, 3, 3]
    kvm.check_integrity()
    # Whole-pool capacity: a request's longest prompt counts its windows, not its length.
    assert kvm.max_blocks_for(16) == 4 + 4 + 4
    kvm2 = hybrid(64, max_num_batched_tokens=8)
    assert kvm2.max_blocks_for(100) == 25 + 2 * (cdiv(W - 1 + 8, BS) + 1)
    assert kvm2.max_blocks_for(kvm2.max_num_tokens) <= kvm2.num_usable_blocks
    assert kvm2.max_blocks_for(kvm2.max_num_tokens + 1) > kvm2.num_usable_blocks


def test_events_name_their_group():
    kvm = hybrid(40)
    a = make_request("a", list(range(25)))
    admit(kvm, a)
    stored = [e for e in kvm.take_events() if isinstance(e, BlockStored)]
    by_group = {e.group_idx: e for e in stored}
    assert sorted(by_group) == [0, 1, 2] and len(stored) == 3
    assert by_group[0].kv_cache_spec_kind == "full_attention"
    assert by_group[0].kv_cache_spec_sliding_window is None
    for g in (1, 2):
        e = by_group[g]
        assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == ("sliding_window", W)
        assert e.block_hashes == by_group[0].block_hashes  # same chain, its own blocks
    kvm.free(a)
    pool = kvm.block_pool
    kvm.evict_blocks([pool.get_cached_block(a.block_hashes[0], 1).block_id])
    (removed,) = kvm.take_events()
    assert isinstance(removed, BlockRemoved) and removed.group_idx == 1
    assert kvm.reset_prefix_cache()
    assert all(not cached for cached in pool.cached_by_group)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=40), num_blocks=st.integers(8, 30))
def test_random_hybrid_workload_keeps_integrity_and_never_leaks(ops, num_blocks):
    kvm = hybrid(num_blocks, max_model_len=40)
    live: list[Request] = []
    n = 0
    for o in ops:
        if o[0] == "add":
            _, p, tail, salted = o
            n += 1
            req = make_request(f"r{n}", PREFIXES[p] + tail, cache_salt="s" if salted else None)
            blocks, hit = kvm.get_computed_blocks(req)
            assert hit < req.num_tokens and hit % BS == 0
            for g, group_blocks in enumerate(blocks):
                assert len(group_blocks) * BS == hit
                for i, blk in enumerate(group_blocks):
                    assert blk.is_null or blk.block_hash == req.block_hashes[i]
                    assert blk.is_null or blk.group_idx == g
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
            else:
                kvm.free(req)
                live.remove(req)
        elif o[0] == "free" and live:
            kvm.free(live.pop(o[1] % len(live)))
        elif o[0] == "reset":
            assert kvm.reset_prefix_cache() == (not live)
        kvm.check_integrity()
        for req in live:
            c = req.num_computed_tokens
            for m in kvm.managers:
                blocks = m.req_to_blocks[req.request_id]
                assert len(blocks) * BS >= c
                skip = m.spec.num_skipped_blocks(c, BS)
                # A window drops only what no later query reads, and keeps the rest.
                assert all(not b.is_null for b in blocks[skip:])
                for i, blk in enumerate(blocks[: m.num_cached_block.get(req.request_id, 0)]):
                    assert blk.is_null or blk.block_hash == req.block_hashes[i]
    for req in live:
        kvm.free(req)
    kvm.check_integrity()
    assert kvm.get_num_free_blocks() == num_blocks - 1


# -- tiny-gemma3, HF-exact -------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = str(make_model(tmp_path_factory.mktemp("gemma3_groups"), "tiny-gemma3"))
    return d, HFOracle(d)


def _prompts(seed: int, lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(3, 500) for _ in range(n - 1)] for n in lens]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _run(llm: LLM, prompts: list[list[int]], n: int, window_bound: bool = True) -> list:
    """Step the engine to the end; after every step each sliding group holds at most
    cdiv(W, bs) + 1 blocks of a decoding request."""
    eng = llm.engine
    kvm = eng.kv_cache_manager
    bound = cdiv(32, 16) + 1
    ids = [eng.add_request(None, p, _greedy(n)) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        for req in eng.scheduler.running:
            # (Once a decode allocated: a prefill's last chunk holds its blocks until then.)
            if window_bound and req.num_output_tokens >= 2:
                for m in kvm.sliding_managers:
                    assert sum(not b.is_null for b in m.req_to_blocks[req.request_id]) <= bound
    return [done[i] for i in ids]


def test_gemma3_groups_match_hf_far_past_the_window(gemma3):
    d, hf = gemma3
    llm = LLM(d, block_size=16, num_kv_blocks=400, max_num_batched_tokens=40, max_num_seqs=4,
              dtype="float32", debug=True)  # fmt: skip
    eng = llm.engine
    kvm = eng.kv_cache_manager
    assert kvm.num_groups == 6 and eng.kv_cache.shape[1] == 1  # one layer per block
    prompts = _prompts(11, [150, 61])
    outs = _run(llm, prompts, 80)  # decodes reach 230 tokens: 7 windows
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf.greedy(p, 80)
    eng.check_integrity()
    assert kvm.get_num_free_blocks() == kvm.num_usable_blocks

    a = prompts[0]
    pool = kvm.block_pool
    hashes = Request("x", a, Params(), block_size=16).block_hashes

    def cached(g: int, i: int) -> int:
        return pool.get_cached_block(hashes[i], g).block_id

    # The out-of-window blocks of a 144-token hit (sliding blocks 0-5) evicted: the hit
    # needs only keys [113, 144) (blocks 7, 8) of each sliding group.
    kvm.evict_blocks([cached(g, i) for g in range(1, 6) for i in range(6)])
    b = a[:144] + _prompts(12, [20])[0]
    (out,) = _run(llm, [b], 12)
    assert out.num_cached_tokens == 144
    assert out.outputs[0].token_ids == hf.greedy(b, 12)
    # One sliding group lost block 8: the longest hit every group agrees on is 128 tokens
    # (keys [97, 128): blocks 6, 7).
    kvm.evict_blocks([cached(3, 8)])
    c = a[:144] + _prompts(13, [9])[0]
    (out,) = _run(llm, [c], 12)
    assert out.num_cached_tokens == 128
    assert out.outputs[0].token_ids == hf.greedy(c, 12)
    eng.check_integrity()
    assert kvm.get_num_free_blocks() == kvm.num_usable_blocks


def test_gemma3_groups_preempt_under_a_small_pool(gemma3):
    d, hf = gemma3
    llm = LLM(d, block_size=16, num_kv_blocks=72, max_num_batched_tokens=40, max_num_seqs=4,
              dtype="float32", debug=True, enable_prefix_caching=False)  # fmt: skip
    prompts = _prompts(21, [120, 97, 133])
    outs = _run(llm, prompts, 40)
    assert llm.get_stats().num_preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf.greedy(p, 40)
    eng = llm.engine
    eng.check_integrity()
    kvm = eng.kv_cache_manager
    assert kvm.get_num_free_blocks() == kvm.num_usable_blocks
    # The pool holds a request's windows, not its length: 600 tokens fit in 71 one-layer
    # blocks (38 full + 5 windows of at most 6 during 40-token prefill chunks); 700 never
    # can and is refused at once (a request that could never fit would preempt itself
    # forever).
    assert kvm.max_num_tokens == 41 * 16
    long_ok, too_long = _prompts(22, [600, 700])
    (out,) = _run(llm, [long_ok], 8)
    assert out.outputs[0].token_ids == hf.greedy(long_ok, 8)
    with pytest.raises(ValueError, match="holds at most 656 tokens"):
        eng.add_request(None, too_long, _greedy(8))
    # Aborted mid-decode: every group's blocks come back.
    ids = [eng.add_request(None, p, _greedy(40)) for p in prompts[:2]]
    for _ in range(12):
        eng.step()
    eng.abort_request([ids[0]])
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_integrity()
    assert kvm.get_num_free_blocks() == kvm.num_usable_blocks


def test_gemma3_hit_loaded_from_the_host_tier_per_group(gemma3):
    """Offloading per group: every group stores its chunks, a hit from the host tier loads
    the full group's chunks and only the sliding groups' window; outputs stay HF-exact."""
    d, hf = gemma3
    # Prefill chunks of 200 tokens complete several 64-token offload chunks at once: their
    # sliding blocks leave the window in the next step, while their stores may still run
    # (pinned until they end).
    kw = dict(block_size=16, num_kv_blocks=900, max_num_batched_tokens=200, dtype="float32",
              debug=True, kv_offload_size=0.05, enable_kv_cache_events=True)  # fmt: skip
    llm = LLM(d, **kw)
    eng = llm.engine
    assert eng.kv_cache_manager.num_groups == 6
    a = _prompts(31, [260])[0]
    (out,) = _run(llm, [a], 12)
    assert out.outputs[0].token_ids == hf.greedy(a, 12)
    events = eng.take_kv_events()
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert sorted({e.group_idx for e in cpu}) == list(range(6))
    assert all((e.kv_cache_spec_sliding_window is None) == (e.group_idx == 0) for e in cpu)
    assert eng.reset_prefix_cache()  # the primary pool forgets: the host tier holds it all
    b = a[:256] + _prompts(32, [7])[0]
    before = eng.connector.stats()
    (out,) = _run(llm, [b], 12)
    assert out.num_cached_tokens == out.metrics.num_external_cached_tokens == 256
    assert out.outputs[0].token_ids == hf.greedy(b, 12)
    after = eng.connector.stats()
    layer_block = eng.runner.kv_block_bytes()  # one layer per block
    # Full group: 16 blocks; each sliding group: keys [225, 256) -> blocks 14, 15.
    assert after.load_bytes - before.load_bytes == (16 + 5 * 2) * layer_block
    assert after.extra["invalid_chunks"] == before.extra["invalid_chunks"] == 0
    eng.check_integrity()
    kvm = eng.kv_cache_manager
    assert not kvm._pins and kvm.get_num_free_blocks() == kvm.num_usable_blocks


def test_gemma3_failed_host_load_before_the_window_restarts_the_request(gemma3):
    """A host-tier chunk of the full group fails verification far before the hit's end: the
    sliding groups hold only the window of the hit (the null block before it), so the
    request cannot recompute from the bad chunk on; it starts over from a fresh lookup (the
    bad chunk is gone from the tier: a shorter hit) and its output stays HF-exact."""
    d, hf = gemma3
    kw = dict(block_size=16, num_kv_blocks=900, max_num_batched_tokens=200, dtype="float32",
              debug=True, kv_offload_size=0.05)  # fmt: skip
    llm = LLM(d, **kw)
    eng = llm.engine
    conn = eng.connector
    a = _prompts(41, [260])[0]
    (out,) = _run(llm, [a], 4)
    assert eng.reset_prefix_cache()  # only the host tier holds the prompt now
    # Group 0's (full attention) chunk 1, tokens [64, 128), is corrupted in the host tier.
    key = conn._chunk_keys(Request("x", a, Params(), block_size=16), 1, 2)[0]
    slot = conn.manager.slot_of(key)
    assert slot is not None
    k = conn.blocks_per_chunk
    conn.tier.blocks[slot * k : (slot + 1) * k].fill_(-1.0)
    b = a[:256] + _prompts(42, [7])[0]
    before = conn.stats().extra["invalid_chunks"]
    (out,) = _run(llm, [b], 12)
    assert conn.stats().extra["invalid_chunks"] == before + 1
    assert out.outputs[0].token_ids == hf.greedy(b, 12)
    # The second lookup: chunk 0 of every group (the sliding groups' window before token 64).
    assert out.num_cached_tokens == out.metrics.num_external_cached_tokens == 64
    eng.check_integrity()
    kvm = eng.kv_cache_manager
    assert not kvm._pins and kvm.get_num_free_blocks() == kvm.num_usable_blocks


def test_mistral_sliding_group_offload_hit_matches_recompute(tmp_path):
    """A window in every layer is one sliding group: the host tier stores and loads it per
    group too (its blocks before the window are the null block), never the null block."""
    d = str(make_model(tmp_path, "tiny-mistral-sw"))  # window 48
    llm = LLM(d, block_size=16, num_kv_blocks=400, kv_offload_size=0.02, dtype="float32",
              debug=True, max_num_batched_tokens=100)  # fmt: skip
    eng = llm.engine
    kvm = eng.kv_cache_manager
    assert kvm.num_groups == 1 and kvm.sliding_managers
    a = _prompts(41, [250])[0]
    _run(llm, [a], 12, window_bound=False)
    while eng.scheduler.has_requests():
        eng.step()
    assert eng.reset_prefix_cache()
    b = a[:240] + _prompts(42, [9])[0]
    before = eng.connector.stats()
    (out,) = _run(llm, [b], 12, window_bound=False)
    after = eng.connector.stats()
    assert out.metrics.num_external_cached_tokens == 192  # three 64-token chunks
    # Keys [145, 192) of the query at 192: blocks 9-11 of 4 layers, not all 12.
    assert after.load_bytes - before.load_bytes == 3 * eng.runner.kv_block_bytes()
    ref = LLM(d, block_size=16, dtype="float32", enable_prefix_caching=False, kv_groups=False)
    assert ref.engine.kv_cache_manager.sliding_managers == []
    (want,) = ref.generate([b], _greedy(12))
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    eng.check_integrity()
    assert kvm.get_num_free_blocks() == kvm.num_usable_blocks
