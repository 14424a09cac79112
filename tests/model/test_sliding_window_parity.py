"""Sliding-window models (Mistral-style window in every layer; Gemma 3's 5 sliding : 1 full
layers) equal transformers in fp32 on prompts several windows long, through chunked prefill,
prefix-cache hits and batched decodes of different lengths, on both attention backends."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.attention import NATIVE_AVAILABLE
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.outputs import SchedulerOutput
from kvserve.engine.request import Request
from kvserve.model.config import ModelConfig
from kvserve.model.presets import make_model, model_config
from tests.engine.test_llm_parity import HFOracle

MAX_TOKENS = 12
BACKENDS = ["torch", "native"] if NATIVE_AVAILABLE else ["torch"]


@pytest.fixture(scope="module", params=["tiny-mistral-sw", "tiny-gemma3"])
def setup(request, tmp_path_factory):
    d = str(make_model(tmp_path_factory.mktemp(request.param), request.param))
    return d, HFOracle(d)


def _prompts(seed: int, lens: list[int], vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in lens]


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_attention_types_follow_hf_rules():
    n = 4
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=n, vocab_size=100)
    base.update(num_attention_heads=4)
    mistral = ModelConfig.from_dict(
        dict(base, architectures=["MistralForCausalLM"], sliding_window=16)
    )
    assert [mistral.layer_window(i) for i in range(n)] == [16] * n
    assert mistral.max_context_len == 2048  # no longer capped at the window
    qwen = dict(base, architectures=["Qwen2ForCausalLM"], sliding_window=16, max_window_layers=2)
    assert ModelConfig.from_dict(qwen).layer_window(3) is None  # use_sliding_window off
    on = ModelConfig.from_dict(dict(qwen, use_sliding_window=True))
    assert [on.layer_window(i) for i in range(n)] == [None, None, 16, 16]
    gemma = ModelConfig.from_dict(model_config("tiny-gemma3"))
    assert [gemma.layer_window(i) for i in range(6)] == [32] * 5 + [None]
    assert gemma.attn_scale == 48**-0.5 and gemma.rope_local_theta == 10000.0
    assert gemma.rope_scaling["rope_type"] == "linear" and gemma.rope_theta == 1e6
    cfg = dict(model_config("tiny-gemma3"), layer_types=None, sliding_window_pattern=3)
    g3 = ModelConfig.from_dict(cfg)
    assert [g3.layer_window(i) for i in range(6)] == [32, 32, None, 32, 32, None]
    # A Gemma 3 1B-style config.json (pre-transformers-5 field names).
    old = dict(base, architectures=["Gemma3ForCausalLM"], num_hidden_layers=6, head_dim=16)
    old.update(sliding_window=512, sliding_window_pattern=6, rope_theta=1e6)
    old.update(rope_local_base_freq=1e4, query_pre_attn_scalar=256, rope_scaling=None)
    g1 = ModelConfig.from_dict(old)
    assert [g1.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert (g1.rope_theta, g1.rope_local_theta, g1.rope_scaling) == (1e6, 1e4, None)
    assert g1.attn_scale == 1 / 16 and g1.final_logit_softcapping is None
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_dict(dict(model_config("tiny-gemma3"), attn_logit_softcapping=50.0))
    llama = ModelConfig.from_dict(dict(base, architectures=["LlamaForCausalLM"]))
    assert llama.layer_window(0) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_matches_hf_across_windows(setup, backend):
    """Prompts 2-6 windows long, prefilled in chunks of 40 tokens next to decodes; then
    prompts sharing their first 96-128 tokens (prefix-cache hits past the window)."""
    d, hf = setup
    llm = LLM(
        d,
        attention_backend=backend,
        block_size=16,
        num_kv_blocks=960,  # 160 blocks of every layer: one layer per block in tiny-gemma3
        max_num_batched_tokens=40,
        max_num_seqs=4,
        enable_prefix_caching=True,
        dtype="float32",
    )
    vocab = llm.engine.runner.model_config.vocab_size
    prompts = _prompts(1, [70, 133, 190, 101], vocab)
    outs = llm.generate(prompts, _greedy())
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf.greedy(p)
    tails = _prompts(2, [9, 30, 17], vocab)
    hits = [prompts[2][:128] + tails[0], prompts[1][:96] + tails[1], prompts[2][:100] + tails[2]]
    outs = llm.generate(hits, _greedy())
    for p, o in zip(hits, outs, strict=True):
        assert o.num_cached_tokens >= 96
        assert o.outputs[0].token_ids == hf.greedy(p)
    assert not llm.engine.has_unfinished_requests()
    assert llm.get_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_logits_match_hf(setup, backend, runner_driver):
    """Every logit of a 151-token prompt whose last 81 tokens run after a cached 70-token
    chunk (shuffled blocks): windowed prefill masks over a gathered context, both RoPE bases,
    final soft-capping."""
    d, hf = setup
    cfg = EngineConfig(model=d, dtype="float32", block_size=16, attention_backend=backend)
    runner = ModelRunner(cfg)
    driver = runner_driver(runner, num_blocks=64)
    prompt = _prompts(3, [151], runner.vocab_size)[0]
    req = Request("r0", prompt, _greedy(), block_size=16)
    driver.step([(req, 70)])
    tables = driver.group_tables["r0"]  # one per KV cache group
    for table in tables:
        while len(table) * 16 < len(prompt):
            table.append(driver.free.pop())
    so = SchedulerOutput(
        scheduled=[req],
        num_scheduled_tokens={"r0": len(prompt) - 70},
        block_ids={"r0": tables[0]},
        group_block_ids={"r0": tables} if len(tables) > 1 else {},
    )
    ours = runner.compute_all_logits(so)["r0"]
    with torch.no_grad():
        ref = hf.model(torch.tensor([prompt])).logits[0, 70:]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
