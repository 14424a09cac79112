"""P/D per KV cache group (tiny-gemma3: 5 sliding layers, W=32, : 1 full), real engines in one
process over loopback sockets.

The producer leases the full group's prompt blocks and each sliding group's window before the
end of the prompt; the consumer pulls only what a hit there needs. Oracle: greedy outputs equal
an engine that recomputes everything; the bytes pulled are the full group's blocks plus the
windows'; a corrupt block is recomputed; offloading chained with P/D still stores and loads.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvserve.engine.kv_cache_spec import cdiv
from kvserve.model.presets import make_model
from tests.kv.test_pd_engines import drain, extra, make_engine, pd_of, prefill, run

BS = 16
WINDOW = 32
NUM_SLIDING = 5


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("gemma3_pd"), "tiny-gemma3")


@pytest.fixture(scope="module")
def reference(gemma3_dir: Path):
    eng = make_engine(gemma3_dir, num_kv_blocks=400, enable_prefix_caching=False, dtype="float32")
    yield eng
    eng.shutdown()


@pytest.fixture
def engines(gemma3_dir: Path):
    """``engines(**config)`` -> a tiny-gemma3 engine, checked back at baseline at the end."""
    made = []

    def make(**kw):
        kw.setdefault("dtype", "float32")
        eng = make_engine(gemma3_dir, **kw)
        made.append(eng)
        return eng

    yield make
    try:
        for eng in made:
            drain(eng)
            eng.check_integrity()
            assert not eng.scheduler.held
            conn = pd_of(eng)
            assert not conn._pulls and not conn._tried and not conn._params_out
            if conn.leases is not None:
                assert conn.leases.num_active == 0
    finally:
        for eng in made:
            eng.shutdown()


def prompts_of(seed: int, lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(3, 500) for _ in range(n - 1)] for n in lens]


def ref_tokens(reference, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in run(reference, prompts, n, [None] * len(prompts))]


def pulled_blocks(num_tokens: int) -> tuple[int, int]:
    """(tokens loaded, blocks pulled over every group) for a prompt pulled whole: the full
    group's blocks up to the hit, each sliding group's window before it."""
    hit = min(num_tokens // BS * BS, num_tokens - 1)
    end = cdiv(hit, BS)
    skipped = max(0, hit - WINDOW + 1) // BS
    return hit, end + NUM_SLIDING * (end - skipped)


def test_pd_groups_equal_recompute_and_move_only_the_windows(engines, reference) -> None:
    """Prompts of several windows, chunked prefill on both sides, pulled concurrently: tokens
    equal recomputation; the bytes pulled are the full group's blocks plus the windows'."""
    lens = [20, 64, 131, 300]
    prompts = prompts_of(1, lens)
    producer = engines(kv_role="producer", max_num_batched_tokens=64)
    consumer = engines(kv_role="consumer", max_num_batched_tokens=64)
    assert producer.kv_cache_manager.num_groups == consumer.kv_cache_manager.num_groups == 6
    params = prefill(producer, prompts)
    for p, n in zip(params, lens, strict=True):
        groups = p["remote_block_ids"]
        assert len(groups) == 6 and len(groups[0]) == n // BS == p["remote_num_tokens"] // BS
        assert all(len(g) <= cdiv(WINDOW - 1, BS) + 1 for g in groups[1:])
    outs = run(consumer, prompts, 10, params)
    want = ref_tokens(reference, prompts, 10)
    assert [o.outputs[0].token_ids for o in outs] == want
    expect = [pulled_blocks(n) for n in lens]
    assert [o.metrics.num_external_cached_tokens for o in outs] == [h for h, _ in expect]
    blocks = sum(b for _, b in expect)
    layer_block = consumer.runner.kv_block_bytes()  # one layer per block
    st = consumer.get_stats().connector
    assert st.extra["pd_blocks_pulled"] == blocks and st.extra["pd_blocks_invalid"] == 0
    assert st.load_bytes == blocks * layer_block
    drain(producer)
    assert extra(producer, "pd_bytes_sent") == blocks * layer_block


def test_pd_groups_corrupt_window_block_is_recomputed(engines, reference) -> None:
    """A sliding group's window block changed after the seal fails its digest: the request
    recomputes (never a wrong token), the producer's blocks are freed."""
    (prompt,) = prompts_of(2, [200])
    producer = engines(kv_role="producer")
    consumer = engines(kv_role="consumer")
    (params,) = prefill(producer, [prompt])
    lease = pd_of(producer).leases.get(params["remote_request_id"])
    assert lease is not None and lease.sealed.wait(30) and lease.digests is not None
    producer.kv_cache[params["remote_block_ids"][3][0]].add_(0.5)
    (out,) = run(consumer, [prompt], 10, [params])
    assert out.outputs[0].token_ids == ref_tokens(reference, [prompt], 10)[0]
    assert extra(consumer, "pd_blocks_invalid") > 0
    drain(producer)
    assert extra(producer, "pd_pulls_served_failed") == 1


def test_pd_groups_chained_with_offload(engines, reference) -> None:
    """With a host tier: the decode leg's blocks come per group from the producer, its
    stores go to the host tier per group, and a later request hits them there."""
    (prompt,) = prompts_of(3, [256])
    kw = dict(kv_offload_size=0.01, kv_offload_block_size=16)
    producer = engines(kv_role="producer", **kw)
    consumer = engines(kv_role="consumer", num_kv_blocks=120, **kw)
    (params,) = prefill(producer, [prompt])
    (out,) = run(consumer, [prompt], 8, [params])
    want = ref_tokens(reference, [prompt], 8)[0]
    assert out.outputs[0].token_ids == want
    hit, blocks = pulled_blocks(256)
    assert out.metrics.num_external_cached_tokens == hit
    assert consumer.reset_prefix_cache()  # the primary pool forgets: the host tier holds it
    (again,) = run(consumer, [prompt], 8, [None])
    assert again.outputs[0].token_ids == want
    assert again.metrics.num_external_cached_tokens > 0
    st = consumer.get_stats().connector
    assert st.extra["pd_blocks_pulled"] == blocks and st.store_bytes > 0


def test_pd_without_groups_and_mismatched_groups(engines, reference) -> None:
    """``kv_groups=False`` on both sides: every layer of every block, one flat list, as before.
    A consumer that groups otherwise than the producer, or parameters that lack a window
    block, refuse the remote KV and recompute (the lease is handed back at once)."""
    prompts = prompts_of(4, [131, 131, 131])
    want = ref_tokens(reference, prompts, 8)
    flat_p = engines(kv_role="producer", kv_groups=False)
    flat_c = engines(kv_role="consumer", kv_groups=False)
    assert flat_p.kv_cache_manager.num_groups == 1
    (params,) = prefill(flat_p, prompts[:1])
    ids = params["remote_block_ids"]
    assert len(ids) == 8 and all(isinstance(b, int) for b in ids)
    (out,) = run(flat_c, prompts[:1], 8, [params])
    assert out.outputs[0].token_ids == want[0]
    assert out.metrics.num_external_cached_tokens == 128
    assert flat_c.get_stats().connector.load_bytes == 8 * flat_c.runner.kv_block_bytes()
    producer = engines(kv_role="producer")
    consumer = engines(kv_role="consumer")
    p1, p2 = prefill(producer, prompts[1:])
    (o1,) = run(flat_c, prompts[1:2], 8, [p1])  # grouped KV, ungrouped consumer
    short = [list(g) for g in p2["remote_block_ids"]]
    short[2] = short[2][1:]  # a sliding group's window without its first block
    (o2,) = run(consumer, prompts[2:], 8, [dict(p2, remote_block_ids=short)])
    assert [o1.outputs[0].token_ids, o2.outputs[0].token_ids] == want[1:]
    assert o1.metrics.num_external_cached_tokens == o2.metrics.num_external_cached_tokens == 0
    assert extra(flat_c, "pd_refused") == 1 and extra(consumer, "pd_refused") == 1
    drain(producer, timeout=60)  # both leases handed back, not expired
    assert extra(producer, "pd_leases_pulled") == 2 and extra(producer, "pd_leases_expired") == 0
