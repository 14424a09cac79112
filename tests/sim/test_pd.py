"""The simulator's P/D: real engines and kv_transfer_params, modelled pulls between instances."""

from __future__ import annotations

import time

from kvserve.config import ServerConfig
from kvserve.engine.sampling_params import SamplingParams
from kvserve.sim.instance import SimCluster, SimEngineConfig
from kvserve.sim.latency_model import get_preset

PROMPT = [(i * 37) % 2000 + 10 for i in range(16 * 20 + 5)]  # 20 full blocks + 5 tokens


def cluster(model_dir, time_scale: float = 0.0, **cfg) -> SimCluster:
    kwargs = dict(
        model=str(model_dir),
        sim_latency="h100-llama8b",
        sim_time_scale=time_scale,
        num_kv_blocks=128,
        max_model_len=4096,
    )
    config = SimEngineConfig(**{**kwargs, **cfg})
    return SimCluster.build(3, config, ServerConfig(port=0), num_prefill=1)


def run(inst, rid: str, prompt: list[int], max_tokens: int, params=None):
    inst.engine.add_request(
        rid, prompt, SamplingParams(max_tokens=max_tokens), kv_transfer_params=params
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in inst.engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError(f"{rid} did not finish")


def free_blocks(inst) -> int:
    return inst.engine.kv_cache_manager.block_pool.get_num_free_blocks()


def stats(inst) -> dict[str, float]:
    return inst.engine.connector.stats().extra


def test_decode_pulls_the_prefill_instance_blocks_and_the_lease_ends(tiny_model_dir) -> None:
    c = cluster(tiny_model_dir)
    try:
        pre, dec, alone = c.instances
        assert [i.endpoint_entry()["role"] for i in c.instances] == ["prefill", "decode", "decode"]
        baseline = free_blocks(pre)
        first = run(pre, "p", PROMPT, 1, {"do_remote_decode": True})
        params = first.kv_transfer_params
        assert params is not None and params["do_remote_prefill"] is True
        assert len(params["remote_block_ids"]) == 20
        assert stats(pre)["pd_leases_active"] == 1  # held for the decode side
        assert free_blocks(pre) == baseline - 21  # all its blocks, until the lease ends
        out = run(dec, "d", PROMPT, 8, params)
        assert stats(dec)["pd_pulls_ok"] == 1 and stats(dec)["pd_blocks_pulled"] == 20
        assert out.metrics.num_external_cached_tokens == 20 * 16
        # The same tokens as an instance that prefilled itself (sampling is deterministic).
        ref = run(alone, "r", PROMPT, 8)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        # The pull ended the lease: the prefill instance's blocks are free (and cached).
        run(pre, "tick", [5, 6, 7], 1)
        assert stats(pre)["pd_leases_active"] == 0 and free_blocks(pre) == baseline
        # The decode side now holds the prompt: a second pull moves only what it lacks.
        params2 = run(pre, "p2", PROMPT + [11] * 40, 1, {"do_remote_decode": True})
        out = run(dec, "d2", PROMPT + [11] * 40, 4, params2.kv_transfer_params)
        assert stats(dec)["pd_blocks_pulled"] == 20 + 2  # 20 held, 2 new blocks
        assert out.metrics.num_cached_tokens == 20 * 16
    finally:
        c.close()


def test_unknown_or_expired_lease_recomputes(tiny_model_dir) -> None:
    c = cluster(tiny_model_dir, kv_lease_timeout=0.2)
    try:
        pre, dec, alone = c.instances
        baseline = free_blocks(pre)
        params = run(pre, "p", PROMPT, 1, {"do_remote_decode": True}).kv_transfer_params
        time.sleep(0.3)
        run(pre, "tick", [5, 6, 7], 1)  # the engine expires the lease on its next step
        assert stats(pre)["pd_leases_active"] == 0 and free_blocks(pre) == baseline
        out = run(dec, "d", PROMPT, 6, params)
        assert stats(dec)["pd_pulls_failed"] == 1 and stats(dec)["pd_blocks_pulled"] == 0
        ref = run(alone, "r", PROMPT, 6)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    finally:
        c.close()


def test_pull_time_follows_the_link(tiny_model_dir) -> None:
    """At time scale 1 a pull of 20 blocks of Llama-8B KV takes its modelled time."""
    latency = get_preset("h100-llama8b").replace(net_bandwidth=1e9, net_latency=0.0)
    c = cluster(tiny_model_dir, time_scale=1.0, sim_latency=latency)
    try:
        pre, dec, _ = c.instances
        params = run(pre, "p", PROMPT, 1, {"do_remote_decode": True}).kv_transfer_params
        t0 = time.monotonic()
        run(dec, "d", PROMPT, 1, params)
        modelled = 20 * 16 * 131072 / 1e9  # 0.042 s over a 1 GB/s link
        assert time.monotonic() - t0 >= modelled
        assert stats(dec)["pd_pulls_ok"] == 1
    finally:
        c.close()
