"""Engine numerics vs Hugging Face transformers on the same weights (the oracle).

Our model runs through the ModelRunner with a paged KV cache and shuffled block tables.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from kvserve.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.presets import make_model
from kvserve.model.tokenizer import Tokenizer

PROMPTS = [
    "The river runs past the old mill, and",
    "Alice",
    "In Kyoto, the engine reads each request and splits the prompt into blocks of sixteen "
    "tokens, then stores every full block. Why is the sky blue? Because",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def model_dir(request, tiny_model_dir, tiny_qwen2_model_dir, tmp_path_factory):
    if request.param == "llama":
        return tiny_model_dir
    if request.param == "qwen2":
        return tiny_qwen2_model_dir
    return make_model(tmp_path_factory.mktemp(request.param), "tiny", arch=request.param)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(model_dir):
    tok = Tokenizer(model_dir)
    hf_tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    assert ids == [hf_tok(p)["input_ids"] for p in PROMPTS]  # same tokenizer in HF
    return ids


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompt_ids):
    out = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            gen = hf_model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        out.append(gen[0, len(ids) :].tolist())
    return out


def _runner(model_dir, dtype="float32", block_size=4):
    return ModelRunner(EngineConfig(model=str(model_dir), dtype=dtype, block_size=block_size))


def _requests(prompt_ids, block_size=4):
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return [
        Request(f"r{i}", ids, greedy, block_size=block_size) for i, ids in enumerate(prompt_ids)
    ]


def test_full_sequence_logits(model_dir, hf_model, prompt_ids, runner_driver):
    runner = _runner(model_dir)
    driver = runner_driver(runner, num_blocks=128)
    # Split each prompt: a first chunk writes the cache, the second reads it back.
    reqs = _requests(prompt_ids)
    first = {r.request_id: max(1, r.num_tokens // 2) for r in reqs}
    driver.step([(r, first[r.request_id] - 1) for r in reqs if first[r.request_id] > 1])
    from kvserve.engine.outputs import SchedulerOutput

    so = SchedulerOutput()
    for r in reqs:
        n = r.num_tokens - r.num_computed_tokens
        table = driver.tables.setdefault(r.request_id, [])
        while len(table) * runner.block_size < r.num_tokens:
            table.append(driver.free.pop())
        so.scheduled.append(r)
        so.num_scheduled_tokens[r.request_id] = n
        so.block_ids[r.request_id] = list(table)
    ours = runner.compute_all_logits(so)
    for r, ids in zip(reqs, prompt_ids, strict=True):
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0, r.num_computed_tokens :]
        torch.testing.assert_close(ours[r.request_id], ref, atol=2e-4, rtol=1e-4)


def test_greedy_matches_hf_generate(model_dir, prompt_ids, hf_greedy, runner_driver):
    runner = _runner(model_dir)
    got = runner_driver(runner).generate(_requests(prompt_ids), NEW_TOKENS)
    assert got == hf_greedy
    assert len(set(hf_greedy[2])) > 4  # the preset is not degenerate


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunked_prefill_same_tokens(model_dir, prompt_ids, hf_greedy, chunk, runner_driver):
    if model_dir.name.startswith(("qwen3", "mistral")) and chunk != 3:
        pytest.skip("one chunk size is enough for the extra architectures")
    runner = _runner(model_dir, block_size=8)
    reqs = _requests(prompt_ids, block_size=8)
    assert runner_driver(runner).generate(reqs, NEW_TOKENS, chunk=chunk) == hf_greedy


def test_bf16_logprobs_close(model_dir, hf_model, prompt_ids):
    """Our bf16 log-probs are about as close to fp32 as HF's own bf16 ones."""
    from kvserve.engine.outputs import SchedulerOutput

    runner = _runner(model_dir, dtype="bfloat16", block_size=16)
    runner.allocate_kv_cache(64)
    ids = prompt_ids[2]
    req = _requests([ids])[0]
    so = SchedulerOutput(
        scheduled=[req], num_scheduled_tokens={"r0": len(ids)}, block_ids={"r0": [5, 3, 9, 7]}
    )
    ours = runner.compute_all_logits(so)["r0"].log_softmax(-1)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
        hf_bf16 = hf_model.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()
        hf_model.float()
    hf_err = (hf_bf16.log_softmax(-1) - ref).abs().mean().item()
    our_err = (ours - ref).abs().mean().item()
    assert our_err < 2 * hf_err + 0.01, (our_err, hf_err)
    assert (ours - ref).abs().max().item() < 1.0
