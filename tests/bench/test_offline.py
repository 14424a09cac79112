"""The offline driver on the real engine (tiny model): records, multi-turn feedback, cache."""

from __future__ import annotations

import pytest

from kvserve.bench.offline import offline_run, run_offline
from kvserve.bench.workloads import Vocab, multi_turn_workload, random_workload


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from kvserve import LLM

    engine = LLM(model=str(tiny_model_dir), num_kv_blocks=256, max_model_len=512)
    yield engine
    engine.shutdown()


def test_random_workload_records(llm, tiny_model_dir):
    vocab = Vocab.from_model_dir(tiny_model_dir)
    w = random_workload(4, 40, 5, vocab=vocab, seed=0)
    res = run_offline(llm, w, progress=False)
    assert len(res.records) == 4 and res.duration > 0
    for r in res.records:
        assert r.ok
        assert r.prompt_tokens == 40 and r.output_tokens == 5
        assert r.ttft is not None and 0 < r.ttft <= r.e2e
        assert r.cached_tokens == 0


def test_multi_turn_feeds_output_ids_back_and_hits_the_cache(llm, tiny_model_dir):
    vocab = Vocab.from_model_dir(tiny_model_dir)
    w = multi_turn_workload(
        2, 3, first_len=40, user_len=10, output_len=6, think_time=0, vocab=vocab, seed=1
    )
    res = run_offline(llm, w, progress=False)
    assert len(res.records) == 6 and all(r.ok for r in res.records)
    by = {(r.session_id, r.turn): r for r in res.records}
    for s in ("s0", "s1"):
        assert [by[s, t].prompt_tokens for t in range(3)] == [40, 56, 72]
        assert by[s, 0].cached_tokens == 0
        # Turn k's prompt starts with turn k-1's prompt + answer: its full blocks are cached.
        assert by[s, 1].cached_tokens == 32  # 46 tokens known -> 2 full blocks of 16
        assert by[s, 2].cached_tokens == 48  # 62 tokens known -> 3 full blocks


def test_offline_run_summary(tiny_model_dir):
    vocab = Vocab.from_model_dir(tiny_model_dir)
    w = random_workload(3, 20, 4, vocab=vocab, seed=2)
    run = offline_run(
        tiny_model_dir,
        w,
        engine_kwargs={"num_kv_blocks": 64, "max_model_len": 256},
        progress=False,
    )
    s = run.summary
    assert (s.completed, s.prompt_tokens, s.output_tokens) == (3, 60, 12)
    assert s.output_throughput > 0 and s.ttft is not None and s.itl is None
    assert run.config["engine"] == {"num_kv_blocks": 64, "max_model_len": 256}
