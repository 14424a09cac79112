"""KV index: keys recomputed from token ids, removals via the engine-hash map, media, bounds,
and the oracle: a real vLLM event capture must give each probe the prefix vLLM cached."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvserve.cluster.kv_index import KVIndex, mask_weights, medium_bit
from kvserve.cluster.prompt_keys import prompt_block_keys
from kvserve.engine.hashing import hash_block_tokens, hash_to_int, salt_digest
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

# A copy of shared/fixtures (vLLM 0.32 capture; see tests/fixtures/README.md).
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EVENTS = FIXTURES / "vllm_kv_events_b32.jsonl"
REQUESTS = FIXTURES / "vllm_kv_events_b32.requests.json"

BS = 4


def engine_hashes(tokens: list[int], salt: int) -> list[int]:
    """A foreign engine's hashes: deterministic but unrelated to ours."""
    rnd = random.Random(hash((salt, tuple(tokens))))
    return [rnd.getrandbits(64) for _ in range(len(tokens) // BS)]


def stored(tokens, hashes, parent=None, medium="GPU", block_size=BS, **kw) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        medium=medium,
        **kw,
    )


def test_keys_are_recomputed_from_tokens_and_parent_chain() -> None:
    idx = KVIndex()
    tokens = list(range(1, 4 * BS + 1))
    eh = [101, 102, 103, 104]
    # Two events: blocks 0-1 without a parent, blocks 2-3 chained to engine hash 102.
    idx.apply_events("a", [stored(tokens[: 2 * BS], eh[:2])])
    idx.apply_events("a", [stored(tokens[2 * BS :], eh[2:], parent=102)])
    ours = [hash_to_int(h) for h in hash_block_tokens(tokens, BS)]
    assert idx.match("a", ours) == (4, 4.0)
    # A prompt that diverges in block 2 matches 2 blocks.
    other = tokens[: 2 * BS] + [999] * (2 * BS)
    assert idx.match("a", [hash_to_int(h) for h in hash_block_tokens(other, BS)])[0] == 2
    assert idx.match("b", ours) == (0, 0.0)
    assert idx.num_blocks == 4


def test_prompt_keys_cap_the_last_token() -> None:
    tokens = list(range(3 * BS))  # exactly 3 blocks: at most 2 can be served from cache
    assert len(prompt_block_keys(tokens, BS)) == 2
    assert len(prompt_block_keys(tokens + [7], BS)) == 3
    assert prompt_block_keys(tokens[: BS - 1], BS) == []


def test_removal_uses_the_engine_hash_map_and_breaks_the_run() -> None:
    idx = KVIndex()
    tokens = list(range(100, 100 + 3 * BS))
    idx.apply_events("a", [stored(tokens, [1, 2, 3])])
    keys = [hash_to_int(h) for h in hash_block_tokens(tokens, BS)]
    idx.apply_events("a", [BlockRemoved(block_hashes=[2], medium="GPU")])
    assert idx.match("a", keys)[0] == 1  # block 2 is held but the run stops at block 1
    assert idx.media("a", keys[2]) == {"GPU"}
    idx.apply_events("a", [BlockRemoved(block_hashes=[99])])  # unknown: counted, ignored
    assert idx.stats.unknown_removals == 1
    assert idx.num_blocks == 2


def test_tier_weights_and_media() -> None:
    idx = KVIndex(tier_weights={"CPU": 0.5})
    tokens = list(range(2 * BS))
    keys = [hash_to_int(h) for h in hash_block_tokens(tokens, BS)]
    idx.apply_events("a", [stored(tokens, [1, 2], medium="CPU")])
    assert idx.match("a", keys) == (2, 1.0)
    idx.apply_events("a", [stored(tokens[:BS], [1], medium="GPU")])  # block 0 also on GPU
    assert idx.match("a", keys) == (2, 1.5)
    assert idx.media("a", keys[0]) == {"GPU", "CPU"}
    idx.apply_events("a", [BlockRemoved(block_hashes=[1], medium="GPU")])
    assert idx.match("a", keys) == (2, 1.0)
    idx.apply_events("a", [BlockRemoved(block_hashes=[1, 2], medium="CPU")])
    assert idx.match("a", keys) == (0, 0.0) and idx.num_blocks == 0
    assert medium_bit(None) == medium_bit("GPU")
    w = mask_weights({})
    assert w[medium_bit("GPU") | medium_bit("REDIS")] == 1.0
    with pytest.raises(ValueError):
        mask_weights({"TAPE": 0.1})


def test_duplicate_stores_need_as_many_removals() -> None:
    idx = KVIndex()
    tokens = list(range(BS))
    keys = [hash_to_int(h) for h in hash_block_tokens(tokens, BS)]
    idx.apply_events("a", [stored(tokens, [7]), stored(tokens, [7])])
    idx.apply_events("a", [BlockRemoved(block_hashes=[7])])
    assert idx.match("a", keys)[0] == 1
    idx.apply_events("a", [BlockRemoved(block_hashes=[7])])
    assert idx.match("a", keys)[0] == 0


def test_foreign_hashes_parent_resolution_and_unknown_parent() -> None:
    idx = KVIndex()
    tokens = list(range(50, 50 + 2 * BS))
    eh = engine_hashes(tokens, 1)
    idx.apply_events("a", [stored(tokens[BS:], eh[1:], parent=12345)])  # parent never seen
    assert idx.stats.unresolved_parents == 1 and idx.num_blocks == 0
    idx.apply_events("a", [stored(tokens[:BS], eh[:1])])
    # Parent evicted, child stored later: resolved through the ghost map.
    idx.apply_events("a", [BlockRemoved(block_hashes=eh[:1])])
    idx.apply_events("a", [stored(tokens[BS:], eh[1:], parent=eh[0])])
    keys = [hash_to_int(h) for h in hash_block_tokens(tokens, BS)]
    assert idx.media("a", keys[1]) == {"GPU"}
    assert idx.match("a", keys)[0] == 0  # block 0 is gone


def test_clear_remove_endpoint_and_block_size_change() -> None:
    idx = KVIndex()
    tokens = list(range(2 * BS))
    idx.apply_events("a", [stored(tokens, [1, 2])])
    idx.apply_events("b", [stored(tokens, [5, 6])])
    assert idx.num_blocks == 4
    idx.apply_events("a", [AllBlocksCleared()])
    assert idx.endpoint_num_blocks("a") == 0 and idx.num_blocks == 2
    idx.remove_endpoint("b")
    assert idx.num_blocks == 0 and idx.endpoints() == ["a"]
    idx.apply_events("a", [stored(tokens, [1, 2])])
    idx.apply_events("a", [stored(tokens, [9], block_size=2 * BS)])  # new block size
    assert idx.endpoint_block_size("a") == 2 * BS and idx.num_blocks == 1


def test_lru_bound_per_endpoint() -> None:
    idx = KVIndex(max_blocks_per_endpoint=3)
    for i in range(5):
        idx.apply_events("a", [stored([i] * BS, [i])])
    assert idx.num_blocks == 3 and idx.stats.evicted_blocks == 2
    first = prompt_block_keys([0] * BS + [0], BS)
    last = prompt_block_keys([4] * BS + [0], BS)
    assert idx.match("a", first)[0] == 0 and idx.match("a", last)[0] == 1
    idx.apply_events("a", [BlockRemoved(block_hashes=[0])])  # evicted: unknown now
    assert idx.num_blocks == 3


def test_extra_keys_and_sliding_window_events() -> None:
    idx = KVIndex()
    tokens = list(range(2 * BS))
    idx.apply_events("a", [stored(tokens, [1, 2], extra_keys=[[salt_digest("salt")], None])])
    salted = prompt_block_keys(tokens + [0], BS, cache_salt="salt")
    plain = prompt_block_keys(tokens + [0], BS)
    assert idx.match("a", salted)[0] == 2 and idx.match("a", plain)[0] == 0
    idx.apply_events("a", [stored(tokens, [3, 4], kv_cache_spec_kind="sliding_window")])
    assert idx.stats.skipped_events == 1
    idx.apply_events("a", [stored(tokens, [5])])  # token count does not match the hashes
    assert idx.stats.skipped_events == 2


def test_match_endpoints_uses_each_endpoint_block_size() -> None:
    idx = KVIndex()
    tokens = list(range(8 * BS + 1))
    idx.apply_events("a", [stored(tokens[: 4 * BS], [1, 2, 3, 4])])
    idx.apply_events("b", [stored(tokens[: 4 * BS], [1, 2], block_size=2 * BS)])
    out = idx.match_endpoints(["a", "b", "c"], lambda bs: prompt_block_keys(tokens, bs))
    assert out == {"a": (4, 4.0, 8), "b": (2, 2.0, 4), "c": (0, 0.0, 0)}


def _fixture_batches() -> list[tuple[int, list]]:
    out = []
    for line in EVENTS.read_text().splitlines():
        topic, seq, payload = (bytes.fromhex(x) for x in json.loads(line))
        assert topic == b"kv@127.0.0.1:8000@tiny"
        out.append((int.from_bytes(seq, "big", signed=True), decode_batch(payload).events))
    return out


def _index_through(batches, through: int) -> KVIndex:
    idx = KVIndex()
    for seq, events in batches:
        if seq <= through:
            idx.apply_events("vllm", events)
    return idx


def test_vllm_fixture_probes_match_what_vllm_cached() -> None:
    meta = json.loads(REQUESTS.read_text())
    bs = meta["block_size"]
    batches = _fixture_batches()
    probes = [r for r in meta["requests"] if r["kind"] == "probe"]
    assert len(probes) == 3 and any(r["num_cached_tokens"] for r in probes)
    for r in probes:
        idx = _index_through(batches, r["events_seen_before_request_through_seq"])
        keys = prompt_block_keys(r["prompt_token_ids"], bs)
        matched, _ = idx.match("vllm", keys)
        assert matched == r["num_cached_tokens"] // bs, r
    # One probe is an exact multiple of the block size: vLLM's cap applies.
    assert any(len(r["prompt_token_ids"]) % bs == 0 and r["num_cached_tokens"] for r in probes)
    # Evictions and the cache reset went through without unresolved references.
    full = _index_through(batches, 10**9)
    assert full.stats.unresolved_parents == 0 and full.stats.unknown_removals == 0
    assert full.stats.clears == 1


def test_vllm_fixture_later_turns_match_what_vllm_cached() -> None:
    """Turns 2 and 3 of each session, against the events of the turns before them."""
    meta = json.loads(REQUESTS.read_text())
    bs = meta["block_size"]
    batches = _fixture_batches()
    turns = [r for r in meta["requests"] if r["kind"] == "turn"]
    group_ends = sorted({r["events_seen_through_seq"] for r in turns})
    checked = 0
    for r in turns:
        g = group_ends.index(r["events_seen_through_seq"])
        if g == 0:
            continue  # first turns share a prefix within their own batch
        idx = _index_through(batches, group_ends[g - 1])
        matched, _ = idx.match("vllm", prompt_block_keys(r["prompt_token_ids"], bs))
        assert matched == r["num_cached_tokens"] // bs, r
        checked += 1
    assert checked == 6
