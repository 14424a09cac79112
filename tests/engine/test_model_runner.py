"""ModelRunner: batch building, KV layout, sampling rules, errors.

Numerics vs Hugging Face live in tests/model/test_hf_parity.py; here the oracle is the same
request run alone.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.outputs import SchedulerOutput
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(EngineConfig(model=str(tiny_model_dir), block_size=4))


def make_req(rid, prompt, **params):
    params.setdefault("temperature", 0.0)
    return Request(rid, prompt, SamplingParams(**params), block_size=4, eos_token_id=1)


PROMPTS = [list(range(10, 31)), list(range(100, 105)), list(range(200, 240)), [7, 8]]


def test_kv_cache_layout(runner):
    mc = runner.model_config
    kv = runner.allocate_kv_cache(10)
    assert kv.shape == (10, mc.num_hidden_layers, 2, 4, mc.num_key_value_heads, mc.head_dim)
    assert kv.dtype == torch.float32 and kv.is_contiguous()
    assert runner.kv_block_bytes() == kv[0].numel() * 4 == kv.nbytes // 10
    with pytest.raises(ValueError):
        runner.allocate_kv_cache(1)


def test_batched_equals_alone_and_requests_untouched(runner, runner_driver):
    alone = []
    for i, p in enumerate(PROMPTS):
        alone += runner_driver(runner, 128).generate([make_req(f"a{i}", p)], 6)
    reqs = [make_req(f"b{i}", p) for i, p in enumerate(PROMPTS)]
    assert runner_driver(runner, 128).generate(reqs, 6, chunk=7) == alone
    # The runner itself never mutates a request.
    req = make_req("c", PROMPTS[0])
    before = copy.deepcopy(req.__dict__)
    so = SchedulerOutput([req], {"c": 5}, {"c": [3, 4]}, total_num_scheduled_tokens=5)
    runner.allocate_kv_cache(8)
    out = runner.execute_model(so)
    assert out.sampled_token_ids == {"c": []}  # partial prefill samples nothing
    assert req.__dict__.keys() == before.keys()
    assert req.all_token_ids == before["all_token_ids"] and req.num_computed_tokens == 0


def test_prefills_before_decodes_are_reordered(runner, runner_driver):
    drv = runner_driver(runner, 64)
    a, b = make_req("a", PROMPTS[0]), make_req("b", PROMPTS[1])
    drv.step([(a, a.num_tokens)])  # a now decodes
    so = SchedulerOutput(
        [b, a],  # prefill listed first
        {"a": 1, "b": b.num_tokens},
        {"a": drv.tables["a"], "b": [drv.free.pop(), drv.free.pop()]},
    )
    out = runner.execute_model(so)
    ref_drv = runner_driver(runner, 64)
    a2, b2 = make_req("a", PROMPTS[0]), make_req("b", PROMPTS[1])
    ref_drv.generate([a2], 2)
    ref_drv.generate([b2], 1)
    # Note: `a` sampled one token in step 1 (appended by the driver); this step samples token 2.
    assert out.sampled_token_ids == {"a": [a2.output_token_ids[1]], "b": b2.output_token_ids}


def test_seeded_sampling_and_logprobs(runner, runner_driver):
    def run(batch_with_other: bool) -> tuple[list[int], list]:
        r = make_req("s", PROMPTS[0], temperature=1.0, seed=42, logprobs=3)
        reqs = [r]
        if batch_with_other:
            reqs = [make_req("o", PROMPTS[2], temperature=1.0), r]
        drv = runner_driver(runner, 128)
        drv.generate(reqs, 8)
        runner.sampler.drop({"s", "o"})
        return r.output_token_ids, r.output_logprobs

    toks, _ = run(False)
    toks2, _ = run(True)
    assert toks == toks2
    # Logprobs come back in ModelRunnerOutput.
    drv = runner_driver(runner, 64)
    r = make_req("l", PROMPTS[1], logprobs=3)
    out = drv.step([(r, r.num_tokens)])
    ((chosen, top),) = out.logprobs["l"]
    assert len(top) == 3 and out.sampled_token_ids["l"][0] in top
    assert chosen == max(top.values()) <= 0.0


def test_bad_inputs_raise(runner, tiny_model_dir, tmp_path):
    runner.allocate_kv_cache(16)
    r = make_req("x", [1, 2, 10**6])
    with pytest.raises(ValueError, match="out of range"):
        runner.execute_model(SchedulerOutput([r], {"x": 3}, {"x": [1]}))
    r = make_req("y", [1, 2, 3])
    with pytest.raises(ValueError, match="too short"):
        runner.execute_model(SchedulerOutput([r], {"y": 3}, {"y": []}))
    with pytest.raises(ValueError, match="cannot compute"):
        runner.execute_model(SchedulerOutput([r], {"y": 4}, {"y": [1]}))
    # Unsupported architecture: clear error naming the supported ones.
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        ModelRunner(EngineConfig(model=str(bad)))
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(EngineConfig(model=str(tiny_model_dir), max_model_len=10**6))


def test_bf16_decode_runs_in_bf16(tiny_model_dir, runner_driver):
    """bf16 end to end (cache, masks, sampling) through prefill and ragged decode steps; its
    greedy tokens track the fp32 runner's (the tiny model's margins are wide at the start)."""
    bf16 = ModelRunner(EngineConfig(model=str(tiny_model_dir), block_size=4, dtype="bfloat16"))
    got = runner_driver(bf16, 128).generate(
        [make_req(f"h{i}", p) for i, p in enumerate(PROMPTS)], 4
    )
    assert bf16.kv_cache.dtype == torch.bfloat16
    fp32 = ModelRunner(EngineConfig(model=str(tiny_model_dir), block_size=4))
    ref = runner_driver(fp32, 128).generate(
        [make_req(f"f{i}", p) for i, p in enumerate(PROMPTS)], 4
    )
    assert all(0 <= t < bf16.vocab_size for toks in got for t in toks)
    assert sum(a[0] == b[0] for a, b in zip(got, ref, strict=True)) >= len(PROMPTS) - 1
