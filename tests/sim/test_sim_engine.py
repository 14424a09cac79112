"""The simulated engine is the real engine with a modelled runner: its cache behaviour
(prefix hits, pool usage, evictions, preemptions, KV events) must equal the real engine's."""

from __future__ import annotations

import random
import time

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.events import BlockRemoved, BlockStored
from kvserve.sim.latency_model import get_preset

from .conftest import sim_engine

COMMON = dict(
    num_kv_blocks=24,  # 23 usable blocks of 16 tokens: prefixes get evicted, requests preempted
    max_model_len=1024,
    max_num_seqs=4,
    max_num_batched_tokens=128,
    enable_kv_cache_events=True,
)


def _script(vocab: int):
    """(step index, request id, prompt, max_tokens): shared prefixes, pool pressure."""
    rng = random.Random(7)

    def toks(n):
        return [rng.randrange(10, vocab) for _ in range(n)]

    p1, p2 = toks(64), toks(120)
    return [
        (0, "a", p1 + toks(20), 3),
        (2, "b", p1 + toks(9), 3),  # hits p1 once a's blocks are cached
        (2, "c", p2 + toks(30), 6),
        (3, "d", toks(150), 4),  # pool pressure: evicts free cached blocks, may preempt
        (6, "e", p1 + toks(40), 2),
        (7, "f", p2 + toks(5), 2),
        (12, "g", p1 + toks(2), 1),
    ]


def _trace(engine: LLMEngine, script) -> list:
    """Per step: stats, per-request cached tokens, and the events' shapes."""
    out = []
    todo = list(script)
    step = 0
    while todo or engine.has_unfinished_requests():
        while todo and todo[0][0] <= step:
            _, rid, prompt, n = todo.pop(0)
            engine.add_request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        outs = engine.step()
        s = engine.get_stats()
        events = [
            (type(e).__name__, getattr(e, "medium", None), len(getattr(e, "block_hashes", ())))
            for e in engine.take_kv_events()
        ]
        out.append(
            (
                step,
                s.num_running,
                s.num_waiting,
                round(s.kv_cache_usage, 6),
                s.prefix_cache_queries,
                s.prefix_cache_hits,
                s.num_preemptions,
                sorted(
                    (o.request_id, o.num_cached_tokens, len(o.outputs[0].token_ids), o.finished)
                    for o in outs
                ),
                events,
            )
        )
        step += 1
        assert step < 500
    engine.check_integrity()
    return out


def test_cache_behaviour_equals_the_real_engine(tiny_model_dir):
    real = LLMEngine(EngineConfig(model=str(tiny_model_dir), **COMMON))
    sim = sim_engine(tiny_model_dir, **COMMON)
    assert sim.num_kv_blocks == real.num_kv_blocks
    script = _script(real.runner.model_config.vocab_size)
    real_trace, sim_trace = _trace(real, script), _trace(sim, script)
    assert sim_trace == real_trace
    # The script exercised what it is for: hits, evictions and preemption.
    stats = sim.get_stats()
    assert stats.prefix_cache_hits > 0
    assert any(ev[0] == "BlockRemoved" for row in sim_trace for ev in row[8])
    assert stats.num_preemptions > 0


def test_prefix_hits_share_blocks_and_count_in_stats(tiny_model_dir):
    engine = sim_engine(tiny_model_dir)
    prefix = list(range(100, 164))  # 4 full blocks
    engine.add_request("x", prefix + [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    used_one = engine.get_stats().kv_cache_usage * engine.kv_cache_manager.num_usable_blocks
    engine.add_request("y", prefix + [8, 9, 10], SamplingParams(max_tokens=4, ignore_eos=True))
    outs = {o.request_id: o for o in engine.step()}
    stats = engine.get_stats()
    used_two = stats.kv_cache_usage * engine.kv_cache_manager.num_usable_blocks
    assert outs["y"].num_cached_tokens == 64
    assert stats.prefix_cache_hits == 64
    assert stats.prefix_cache_queries == 2 * 67
    # y holds only its own last block beyond the 4 shared ones.
    assert round(used_two - used_one) == 1
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    stored = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 4  # the prefix, stored once
    assert all(e.medium == "GPU" for e in stored)


def test_outputs_are_deterministic_and_run_to_max_tokens(tiny_model_dir):
    a, b = sim_engine(tiny_model_dir), sim_engine(tiny_model_dir)
    prompt = list(range(20, 60))
    for eng in (a, b):
        eng.add_request("r", prompt, SamplingParams(max_tokens=12))
    outs = []
    for eng in (a, b):
        last = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                last = o
        outs.append(last)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert len(outs[0].outputs[0].token_ids) == 12  # EOS is never sampled
    assert outs[0].outputs[0].finish_reason == "length"
    assert outs[0].outputs[0].text


def test_steps_take_the_modelled_time(tiny_model_dir):
    lat = get_preset("cpu-tiny")
    engine = sim_engine(tiny_model_dir, sim_time_scale=1.0, max_num_batched_tokens=512)
    engine.add_request("p", list(range(10, 410)), SamplingParams(max_tokens=1))
    t0 = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - t0
    assert wall >= lat.prefill_time(400) * 0.95
    stats = engine.runner.snapshot()
    assert stats.steps == 1 and stats.prefill_tokens == 400
    assert stats.modelled_s == pytest.approx(lat.prefill_time(400))


def test_events_removed_on_eviction_carry_the_gpu_medium(tiny_model_dir):
    engine = sim_engine(tiny_model_dir, num_kv_blocks=8)  # 7 usable blocks
    for i, base in enumerate((100, 300, 500)):
        engine.add_request(f"r{i}", list(range(base, base + 64)), SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
    events = engine.take_kv_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed and all(e.medium == "GPU" for e in removed)
    engine.check_integrity()
