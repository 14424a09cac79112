"""End to end: storage tiers below the host tier, on the tiny model.

Oracle: greedy outputs must equal recomputation (an engine without prefix caching or
offloading) whether a prefix came from a storage tier of this instance, from a tier another
instance wrote, or a tier chunk was found corrupt (then it is recomputed). Engines are driven
through ``LLMEngine`` with a step bound (``run``), which also waits for the cascade writes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvserve import LLM
from tests.kv.test_offload_e2e import assert_idle, make_llm, rand_prompt, ref_tokens, run


def tier_llm(model_dir, num_kv_blocks: int, **kw) -> LLM:
    """``make_llm`` with the tier writer process at normal CPU priority: on a CI machine whose
    cores other jobs keep busy, a ``SCHED_IDLE`` writer (the default) can get no CPU for longer
    than ``run``'s step bound waits for the cascade (the policy is tested on its own:
    test_storage_worker, test_storage_writer)."""
    kw.setdefault("kv_tier_write_policy", "normal")
    return make_llm(model_dir, num_kv_blocks, **kw)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> LLM:
    llm = LLM(model=str(tiny_model_dir), num_kv_blocks=1024, enable_prefix_caching=False)
    yield llm
    llm.shutdown()


def tier_stats(llm: LLM) -> dict[str, dict[str, float]]:
    return llm.get_stats().connector.tiers


def only_tier(llm: LLM) -> dict[str, float]:
    (row,) = tier_stats(llm).values()
    return row


def test_cross_instance_through_shared_fs(tiny_model_dir, reference, tmp_path) -> None:
    """A prompt prefilled on instance A is a storage hit on instance B (same fs tier)."""
    rng = random.Random(11)
    a = rand_prompt(rng, 200)
    b = a + rand_prompt(rng, 7)
    tier = [f"fs:path={tmp_path / 'shared'},size=0.05"]
    inst_a = tier_llm(tiny_model_dir, num_kv_blocks=64, kv_tier=tier)
    try:
        (oa,) = run(inst_a, [a], 4)
        written = only_tier(inst_a)["written"]
        assert written >= 12  # 200 tokens = 12 full chunks of 16
        events = inst_a.engine.take_kv_events()
        stored = [e for e in events if getattr(e, "medium", None) == "STORAGE"]
        assert stored and all(e.tier == only_tier_id(inst_a) and e.shared for e in stored)
    finally:
        inst_a.shutdown()
    inst_b = tier_llm(tiny_model_dir, num_kv_blocks=64, kv_tier=tier)
    try:
        (ob,) = run(inst_b, [b], 4)
        assert ob.metrics.num_cached_tokens == 0  # B never saw it
        assert ob.metrics.num_external_cached_tokens >= 192
        assert [oa.outputs[0].token_ids, ob.outputs[0].token_ids] == ref_tokens(
            reference, [a, b], 4
        )
        row = only_tier(inst_b)
        assert row["hits"] >= 12 and row["corrupt"] == 0
        assert inst_b.get_stats().connector.extra["tier_loaded_chunks"] >= 12
        # Staged chunks stay in B's host tier: the next request hits there.
        (again,) = run(inst_b, [a + [5, 6, 7]], 2)
        assert again.metrics.num_cached_tokens + again.metrics.num_external_cached_tokens >= 192
        assert only_tier(inst_b)["hits"] == row["hits"]  # served above the storage tier
    finally:
        inst_b.shutdown()


def forget_above_storage(llm: LLM) -> None:
    """Empty the primary pool's prefix cache and the host tier (the engine must be idle):
    the next request finds its prefix only in the storage tiers."""
    assert llm.reset_prefix_cache()
    llm.engine.connector.manager.clear()


def only_tier_id(llm: LLM) -> str:
    (tid,) = tier_stats(llm)
    return tid


def test_corrupt_shared_chunks_are_recomputed(tiny_model_dir, reference, tmp_path) -> None:
    """Bit flips in the shared tier: B finds them at read (the lookup said present),
    recomputes, outputs unchanged; bad files are removed and counted."""
    rng = random.Random(12)
    a = rand_prompt(rng, 160)
    b = a + rand_prompt(rng, 5)
    root = tmp_path / "shared"
    tier = [f"fs:path={root},size=0.05"]
    inst_a = tier_llm(tiny_model_dir, num_kv_blocks=64, kv_tier=tier)
    try:
        run(inst_a, [a], 2)
    finally:
        inst_a.shutdown()
    files = sorted(Path(root).rglob("*.kvc"))
    assert len(files) >= 10
    # One payload bit flipped in every chunk (which file holds which chunk is a hash).
    for f in files:
        data = bytearray(f.read_bytes())
        data[-100] ^= 0x10
        f.write_bytes(bytes(data))
    inst_b = tier_llm(tiny_model_dir, num_kv_blocks=64, kv_tier=tier)
    try:
        (ob,) = run(inst_b, [b], 4)
        assert ob.outputs[0].token_ids == ref_tokens(reference, [b], 4)[0]
        row = only_tier(inst_b)
        assert row["corrupt"] >= 1 and row["hits"] == 0
        assert ob.metrics.num_external_cached_tokens == 0  # all recomputed
        # Removed when found bad, then written again by B's own (recomputed) stores.
        assert row["written"] >= row["corrupt"]
        assert_idle(inst_b)
    finally:
        inst_b.shutdown()


def test_disk_tier_below_a_small_host_tier(tiny_model_dir, reference, tmp_path) -> None:
    """The working set exceeds the host tier: evicted prompts come back from local disk."""
    rng = random.Random(13)
    llm0 = make_llm(tiny_model_dir, num_kv_blocks=32)
    chunk_bytes = llm0.engine.runner.kv_block_bytes()  # 16-token chunks = one block
    llm0.shutdown()
    host_gib = 24 * chunk_bytes / (1 << 30)  # 24 chunks of host memory
    llm = tier_llm(
        tiny_model_dir,
        num_kv_blocks=32,
        kv_offload_size=host_gib,
        kv_tier=[f"disk:path={tmp_path / 'disk'},size={400 * chunk_bytes}B"],
    )
    try:
        prompts = [rand_prompt(rng, 150) for _ in range(4)]  # 9 chunks each: 36 > 24
        first = [run(llm, [p], 3)[0] for p in prompts]  # one at a time: every chunk stored
        assert only_tier(llm)["written"] == 36
        again = [p + [9, 9] for p in prompts]
        outs = [run(llm, [p], 3)[0] for p in again]
        # The first prompts were evicted from the host tier: they came from disk.
        assert only_tier(llm)["hits"] >= 9
        assert all(
            o.metrics.num_cached_tokens + o.metrics.num_external_cached_tokens >= 144 for o in outs
        )
        assert [o.outputs[0].token_ids for o in first + outs] == ref_tokens(
            reference, prompts + again, 3
        )
        assert_idle(llm)
    finally:
        llm.shutdown()


def test_cross_instance_through_redis(tiny_model_dir, reference, redis_server) -> None:
    """The same through a real Valkey/Redis server: B loads what A computed."""
    rng = random.Random(14)
    a = rand_prompt(rng, 130)
    b = a + rand_prompt(rng, 6)
    tier = [f"redis:url={redis_server.url}"]
    inst_a = tier_llm(tiny_model_dir, num_kv_blocks=64, kv_tier=tier)
    try:
        (oa,) = run(inst_a, [a], 3)
        assert only_tier(inst_a)["written"] >= 8
    finally:
        inst_a.shutdown()
    inst_b = tier_llm(tiny_model_dir, num_kv_blocks=64, kv_tier=tier)
    try:
        (ob,) = run(inst_b, [b], 3)
        assert ob.metrics.num_external_cached_tokens >= 128
        assert [oa.outputs[0].token_ids, ob.outputs[0].token_ids] == ref_tokens(
            reference, [a, b], 3
        )
        assert_idle(inst_b)
    finally:
        inst_b.shutdown()


def test_redis_faults_degrade_to_recompute(tiny_model_dir, reference, redis_server_factory) -> None:
    """The server stopped, hung (SIGSTOP) and restarted under a running engine: every request
    finishes with the recomputed output; the tier works again once the server is back."""
    rng = random.Random(15)
    srv = redis_server_factory()
    tier = [f"redis:url={srv.url},socket_timeout=0.5"]
    llm = tier_llm(tiny_model_dir, num_kv_blocks=32, kv_tier=tier, kv_tier_lookup_timeout=0.2)
    try:
        base = rand_prompt(rng, 100)
        run(llm, [base], 2)
        assert only_tier(llm)["written"] >= 6
        prompts = [base + rand_prompt(rng, 5) for _ in range(2)]
        want = ref_tokens(reference, prompts + [base + [3, 3]], 3)

        srv.stop()  # down: lookups fail fast, writes fail, nothing hangs
        forget_above_storage(llm)
        outs = run(llm, prompts[:1], 3)
        assert outs[0].outputs[0].token_ids == want[0]
        assert only_tier(llm)["errors"] >= 1

        srv.start()  # back (an empty server: persistence is off)
        forget_above_storage(llm)
        run(llm, [base], 1)  # recomputed, stored, written to the server
        forget_above_storage(llm)
        srv.pause()  # hung: the lookup times out, the request recomputes
        try:
            outs = run(llm, prompts[1:], 3)
        finally:
            srv.resume()
        assert outs[0].outputs[0].token_ids == want[1]
        assert llm.get_stats().connector.extra["tier_lookup_timeouts"] >= 1

        # Recovered: a store and a hit through the restarted server.
        forget_above_storage(llm)
        run(llm, [base], 1)
        forget_above_storage(llm)
        (out,) = run(llm, [base + [3, 3]], 3)
        assert out.outputs[0].token_ids == want[2]
        assert out.metrics.num_external_cached_tokens >= 96
    finally:
        llm.shutdown()
