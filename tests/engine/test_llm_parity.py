"""End-to-end engine correctness: greedy tokens equal Hugging Face transformers' on the same
weights, however the KV got there (prefix cache, chunked prefill, preemption, mixed batches)."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams

MAX_TOKENS = 12


def _prompts(seed: int, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class HFOracle:
    """Greedy continuation computed by transformers (cached per prompt)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.cache: dict[tuple[int, ...], list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
        key = tuple(prompt)
        if key not in self.cache:
            seq = list(prompt)
            for _ in range(n):  # full recompute each step: no cache API to trust
                logits = self.model(torch.tensor([seq]), use_cache=False).logits
                seq.append(int(logits[0, -1].argmax()))
            self.cache[key] = seq[len(prompt) :]
        return self.cache[key]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tiny_model_dir, tiny_qwen2_model_dir):
    d = str(tiny_model_dir if request.param == "llama" else tiny_qwen2_model_dir)
    return d, HFOracle(d)


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _assert_idle(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    eng.check_integrity()
    assert llm.get_stats().kv_cache_usage == 0.0


def _vocab(llm: LLM) -> int:
    return llm.engine.runner.model_config.vocab_size


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_matches_hf(setup, prefix_caching):
    d, hf = setup
    llm = LLM(d, num_kv_blocks=256, enable_prefix_caching=prefix_caching, max_num_seqs=8)
    prompts = _prompts(1, 6, 1, 90, _vocab(llm))
    outs = llm.generate(prompts, _greedy())
    for p, o in zip(prompts, outs, strict=True):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == hf.greedy(p)
        assert o.outputs[0].finish_reason == "length"
    _assert_idle(llm)


@pytest.mark.parametrize("budget", [7, 16, 33])
def test_chunked_prefill_matches_hf(setup, budget):
    d, hf = setup
    llm = LLM(d, num_kv_blocks=256, max_num_batched_tokens=budget, max_num_seqs=4)
    prompts = _prompts(2, 4, 20, 120, _vocab(llm))
    outs = llm.generate(prompts, _greedy())
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf.greedy(p)
    _assert_idle(llm)


def test_warm_hit_in_mixed_batch(setup):
    d, hf = setup
    llm = LLM(d, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    vocab = _vocab(llm)
    shared = _prompts(3, 1, 70, 70, vocab)[0]
    llm.generate([shared], _greedy())  # warm the prefix cache
    others = _prompts(4, 3, 10, 60, vocab)
    # The hit lands at different positions of a batch that also holds cold prefills.
    for pos in range(3):
        batch = list(others)
        hit = shared[: 40 + 9 * pos] + others[pos][:5]
        batch.insert(pos, hit)
        outs = llm.generate(batch, _greedy())
        assert outs[pos].num_cached_tokens >= 32
        for p, o in zip(batch, outs, strict=True):
            assert o.outputs[0].token_ids == hf.greedy(p)
    _assert_idle(llm)


def test_exact_block_multiple_prompt_recomputes_last_token(setup):
    d, hf = setup
    llm = LLM(d, num_kv_blocks=64, block_size=16)
    p = _prompts(5, 1, 64, 64, _vocab(llm))[0]
    first = llm.generate([p], _greedy())[0]
    second = llm.generate([p], _greedy())[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48  # never the last token: 3 of 4 blocks
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == hf.greedy(p)


def test_preemption_matches_hf(setup):
    d, hf = setup
    # 12 usable blocks of 16 tokens: 6 requests of ~60 tokens cannot all run at once.
    llm = LLM(d, num_kv_blocks=13, max_num_seqs=6, max_num_batched_tokens=64)
    prompts = _prompts(6, 6, 40, 60, _vocab(llm))
    outs = llm.generate(prompts, _greedy())
    assert llm.get_stats().num_preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf.greedy(p)
    _assert_idle(llm)
