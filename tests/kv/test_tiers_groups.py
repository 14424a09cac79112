"""Storage tiers per KV cache group, end to end on tiny-gemma3 (one full-attention layer, five
sliding-window layers of window 32: six one-layer groups).

Engine A stores a prompt; a fresh engine B on the same tier (a shared file system, a real
Valkey/Redis server) finds it only there. Oracles: B's greedy output equals transformers' (fp32)
and A's; B reads the full group's every chunk and each sliding group's window chunk only (tier
hits and bytes vs every layer's); a chunk of another group or a corrupt one is a miss.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvserve import LLM
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams as Params
from kvserve.kv.backends.chunk_format import group_chunk_key
from kvserve.kv.events import BlockRemoved, BlockStored
from kvserve.model.presets import make_model
from tests.engine.test_kv_groups import _greedy, _prompts, _run
from tests.engine.test_llm_parity import HFOracle

CHUNK = 64  # tokens per offload chunk: 4 blocks of 16
GROUPS = 6


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = str(make_model(tmp_path_factory.mktemp("gemma3_tiers"), "tiny-gemma3"))
    return d, HFOracle(d)


def make_engine(model_dir: str, tier: str, seed: str = "kvserve") -> LLM:
    # The writer at normal priority, as in test_tiers_e2e.tier_llm (a loaded CI machine).
    llm = LLM(model_dir, block_size=16, num_kv_blocks=400, max_num_batched_tokens=128,
              dtype="float32", debug=True, kv_offload_size=0.02, kv_offload_block_size=CHUNK,
              kv_tier=[tier], prefix_hash_seed=seed, enable_kv_cache_events=True,
              kv_tier_write_policy="normal")  # fmt: skip
    assert llm.engine.kv_cache_manager.num_groups == GROUPS  # no fallback to one group
    return llm


def tier_row(llm: LLM) -> dict[str, float]:
    (row,) = llm.get_stats().connector.tiers.values()
    return row


def drain(llm: LLM) -> None:
    """Step until the cascade writes ended; then nothing is left in flight."""
    eng = llm.engine
    for _ in range(2000):
        if not eng.has_unfinished_requests() and not eng.connector.has_pending_work():
            break
        eng.step()
    conn = eng.connector
    assert not conn._jobs and not conn._reqs and not conn._group_stages and not conn._stage_ops
    eng.check_integrity()
    kvm = eng.kv_cache_manager
    assert not kvm._pins and kvm.get_num_free_blocks() == kvm.num_usable_blocks


def store_on_a(model_dir: str, tier: str, prompt: list[int], seed: str = "kvserve") -> list:
    a = make_engine(model_dir, tier, seed)
    try:
        (out,) = _run(a, [prompt], 4)
        drain(a)
        row = tier_row(a)
        assert row["written"] + row["write_skipped"] == 4 * GROUPS  # every group's 4 chunks
        return out.outputs[0].token_ids
    finally:
        a.shutdown()


def hit_on_b(model_dir: str, tier: str, prompt: list[int], seed: str = "kvserve"):
    b = make_engine(model_dir, tier, seed)
    try:
        (out,) = _run(b, [prompt], 12)
        drain(b)
        return out, tier_row(b), b.engine.runner.kv_block_bytes() * CHUNK // 16
    finally:
        b.shutdown()


def check_window_hit(gemma3, tier: str, seed: str = "kvserve", suffix: int = 7) -> None:
    d, hf = gemma3
    a = _prompts(51, [260])[0]
    a_out = store_on_a(d, tier, a, seed)
    assert a_out == hf.greedy(a, 4)
    b = a[:256] + _prompts(52, [suffix])[0]
    out, row, chunk_bytes = hit_on_b(d, tier, b, seed)
    assert out.num_cached_tokens == out.metrics.num_external_cached_tokens == 256
    assert out.outputs[0].token_ids == hf.greedy(b, 12)
    # The full group's 4 chunks, each sliding group's window chunk (keys [225, 256): chunk
    # 3): 9 chunks of one layer, not the 24 every layer's chunks of 256 tokens would be.
    assert row["hits"] == 4 + (GROUPS - 1) and row["corrupt"] == 0
    assert row["read_bytes"] == 9 * chunk_bytes


def test_fs_tier_hit_on_a_fresh_engine_reads_only_windows(gemma3, tmp_path):
    check_window_hit(gemma3, f"fs:path={tmp_path / 'shared'},size=0.05")


def test_redis_tier_hit_on_a_fresh_engine_reads_only_windows(gemma3, redis_server):
    """A prompt longer than what A stored (a hit shorter than the longest looked for): the
    sliding groups' window lookups follow the full group's run."""
    # Own hash seed: a namespace no other test of the session's server writes.
    tier = f"redis:url={redis_server.url}"
    check_window_hit(gemma3, tier, seed="groups-redis", suffix=100)


def test_foreign_group_or_corrupt_chunk_is_a_miss(gemma3, tmp_path):
    """Group 3's chunk copied over group 2's, and group 4's bit-flipped: B reads them, finds
    the header's key (or the hash) wrong, and recomputes; the output never changes."""
    d, hf = gemma3
    root = tmp_path / "shared"
    tier = f"fs:path={root},size=0.05"
    a = _prompts(61, [260])[0]
    store_on_a(d, tier, a)
    last = Request("x", a, Params(), block_size=16).block_hashes[15]  # chunk 3's key
    (ns,) = list(Path(root).iterdir())

    def path(g: int) -> Path:
        key = group_chunk_key(last, g)
        return ns / key[:1].hex() / f"{key.hex()}.kvc"

    shutil.copyfile(path(3), path(2))
    data = bytearray(path(4).read_bytes())
    data[-100] ^= 0x10
    path(4).write_bytes(bytes(data))
    b = a[:256] + _prompts(62, [7])[0]
    out, row, _ = hit_on_b(d, tier, b)
    assert out.outputs[0].token_ids == hf.greedy(b, 12)
    assert row["corrupt"] == 2
    # Without groups 2 and 4's window the 256-token hit is gone: B recomputed it.
    assert out.metrics.num_external_cached_tokens == 0


def test_mistral_sliding_group_from_a_disk_tier(tmp_path):
    """A window in every layer (one sliding group) on a disk tier (lookups from its index in
    memory): only the window's chunk comes back from disk, output equals recompute."""
    d = str(make_model(tmp_path, "tiny-mistral-sw"))  # window 48, 4 layers
    # The writer at normal priority, as in test_tiers_e2e.tier_llm (a loaded CI machine).
    llm = LLM(d, block_size=16, num_kv_blocks=400, kv_offload_size=0.02, dtype="float32",
              debug=True, max_num_batched_tokens=100, kv_offload_block_size=CHUNK,
              kv_tier=[f"disk:path={tmp_path / 'disk'},size=0.05"],
              kv_tier_write_policy="normal")  # fmt: skip
    try:
        kvm = llm.engine.kv_cache_manager
        assert kvm.num_groups == 1 and kvm.sliding_managers
        assert llm.engine.connector._lookup_in_memory
        a = _prompts(71, [250])[0]
        _run(llm, [a], 4, window_bound=False)
        drain(llm)
        assert llm.reset_prefix_cache()
        llm.engine.connector.manager.clear()  # only the disk tier holds it now
        b = a[:240] + _prompts(72, [9])[0]
        (out,) = _run(llm, [b], 12, window_bound=False)
        drain(llm)
        # A 192-token hit: keys [145, 192) are chunk 2 only (of 3).
        assert out.metrics.num_external_cached_tokens == 192
        row = tier_row(llm)
        assert row["hits"] == 1 and row["read_bytes"] == 4 * llm.engine.runner.kv_block_bytes()
    finally:
        llm.shutdown()
    ref = LLM(d, block_size=16, dtype="float32", enable_prefix_caching=False, kv_groups=False)
    (want,) = ref.generate([b], _greedy(12))
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_private_tier_events_name_their_group(gemma3, tmp_path):
    """A small disk tier (private: its events list its chunks) stores every group's chunks
    and evicts some: BlockStored and BlockRemoved of the STORAGE medium carry the group."""
    d, _ = gemma3
    tier = f"disk:path={tmp_path / 'disk'},size={12 * (64 << 10) + 12 * 4096}B"
    llm = make_engine(d, tier)
    try:
        for seed in (81, 82):
            _run(llm, _prompts(seed, [260]), 2)
            drain(llm)
        events = [e for e in llm.engine.take_kv_events() if e.medium == "STORAGE"]
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert {e.group_idx for e in stored} == set(range(GROUPS))
        assert removed and {e.group_idx for e in removed} - {0}
        windows = {e.group_idx: e.kv_cache_spec_sliding_window for e in stored}
        assert windows[0] is None and all(windows[g] == 32 for g in range(1, GROUPS))
    finally:
        llm.shutdown()
