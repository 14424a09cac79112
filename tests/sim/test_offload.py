"""The sim's host tier: the real offloading connector and manager, with modelled transfers."""

from __future__ import annotations

import pytest

from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.events import BlockRemoved, BlockStored
from kvserve.sim.latency_model import get_preset
from kvserve.sim.offload import SimOffloadingConnector

from .conftest import sim_engine

BLOCK_BYTES = 16 * 4096  # cpu-tiny: 4 KiB of KV per token


def _run(engine, rid, prompt, max_tokens=1):
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    last = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            last = o
    return last


def _offload_engine(model_dir, tier_blocks: int, **kw):
    latency = get_preset("cpu-tiny").replace(cpu_bandwidth=16e6, transfer_latency=0.0)
    return sim_engine(
        model_dir,
        num_kv_blocks=12,  # 11 usable blocks
        kv_offload_size=tier_blocks * BLOCK_BYTES / (1 << 30),
        sim_latency=latency,
        **kw,
    )


def test_prefix_evicted_from_the_pool_loads_from_the_tier(tiny_model_dir):
    engine = _offload_engine(tiny_model_dir, tier_blocks=32, sim_time_scale=1.0)
    assert isinstance(engine.connector, SimOffloadingConnector)
    assert engine.config.kv_connector == "sim-offload"
    prefix = list(range(100, 164))  # 4 blocks
    _run(engine, "a", prefix + [1, 2, 3])
    _run(engine, "b", list(range(300, 476)))  # the whole pool: evicts all of a's blocks
    out = _run(engine, "c", prefix + [7, 8, 9])
    assert out.metrics.num_cached_tokens == 0
    assert out.metrics.num_external_cached_tokens == 64
    stats = engine.get_stats().connector
    assert stats.load_bytes == 4 * BLOCK_BYTES
    # Modelled seconds at 16 MB/s, and the request really waited that long (time_scale 1).
    assert stats.load_time_s == pytest.approx(4 * BLOCK_BYTES / 16e6)
    assert out.metrics.first_token_time - out.metrics.first_scheduled_time >= 4 * BLOCK_BYTES / 16e6
    events = engine.take_kv_events()
    cpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in cpu_stored) >= 4 + 11
    engine.check_integrity()
    engine.shutdown()


def test_a_full_tier_evicts_and_says_so(tiny_model_dir):
    engine = _offload_engine(tiny_model_dir, tier_blocks=6)
    _run(engine, "a", list(range(100, 164)) + [1])
    _run(engine, "b", list(range(300, 460)))
    assert engine.connector.manager.num_chunks <= 6
    events = engine.take_kv_events()
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert removed, "storing b into a full tier must evict a's chunks"
    stats = engine.get_stats().connector
    assert stats.extra["evicted_chunks"] >= 4
    engine.check_integrity()
    engine.shutdown()
