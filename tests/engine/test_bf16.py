"""bf16 end to end (packed projections where the CPU has bf16 units, paged prefill and decode)
against transformers run in bf16 on the same weights; the dtype ``auto`` picks.

Tolerance, and why: ours and transformers' bf16 runs are two bf16 evaluations of the same fp32
network, rounding at the same points (bf16 weights and activations, fp32 norms and softmax)
but accumulating in different orders (fused QKV / gate-up GEMMs, oneDNN vs MKL blocking, paged
attention). Each differs from the fp32 result by its own rounding noise, so by the triangle
inequality ours differs from transformers' bf16 by at most about twice transformers' own
distance to fp32 at the same position, ``noise``. Hence, teacher-forced on one token stream:
- every logit: ``|ours - hf_bf16| <= 2 * noise + 2 ulp(bf16)`` of the largest logit at that
  position (the last term covers the final rounding of both outputs to bf16);
- top-1: equal wherever transformers' bf16 top-1 beats its runner-up by more than that bound
  (a closer call is a coin toss that bf16 rounding may flip either way), and on >= 90% of all
  positions.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.outputs import SchedulerOutput
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import cpu_has_native_bf16, resolve_dtype
from kvserve.model.packed_linear import PackedLinear, can_pack
from kvserve.model.presets import make_model
from kvserve.model.tokenizer import Tokenizer

PROMPT = (
    "In Kyoto, the engine reads each request and splits the prompt into blocks of sixteen "
    "tokens, then stores every full block. Why is the sky blue? Because"
)
NEW_TOKENS = 24
BF16_ULP = 2.0**-7  # spacing of bf16 numbers in [1, 2): 7 stored mantissa bits


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tiny_model_dir, tiny_qwen2_model_dir, tmp_path_factory):
    """Llama (GQA, llama3 RoPE), Qwen2 (q/k/v bias, tied embeddings), Qwen3 (q/k norms)."""
    if request.param == "llama":
        return tiny_model_dir
    if request.param == "qwen2":
        return tiny_qwen2_model_dir
    return make_model(tmp_path_factory.mktemp(request.param), "tiny", arch=request.param)


def _hf_logits(model_dir, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _hf_bf16_greedy(model_dir, prompt: list[int]) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    x = torch.tensor([prompt])
    with torch.no_grad():
        gen = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return gen[0].tolist()


def _our_logits(runner: ModelRunner, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Teacher-forced: the prompt in two prefill chunks (the second reads the first from the
    paged cache), then one decode step per token; fp32 logits of every position."""
    runner.allocate_kv_cache(64)
    bs = runner.block_size
    table = [37, 5, 22, 9, 14, 41, 3, 30, 18, 7][: -(-len(ids) // bs)]  # scattered blocks
    req = Request("r", ids, SamplingParams(max_tokens=1), block_size=bs)
    out = []
    half = prompt_len // 2
    for start, end in [(0, half), (half, prompt_len)] + [
        (p, p + 1) for p in range(prompt_len, len(ids))
    ]:
        so = SchedulerOutput(
            scheduled=[req], num_scheduled_tokens={"r": end - start}, block_ids={"r": table}
        )
        out.append(runner.compute_all_logits(so)["r"].cpu())
        req.num_computed_tokens = end
    return torch.cat(out)


def test_auto_dtype_follows_hardware_and_checkpoint():
    cpu = torch.device("cpu")
    native = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", cpu, "bfloat16") == native
    assert resolve_dtype("auto", cpu, "float16") == native
    assert resolve_dtype("auto", cpu, "float32") == torch.float32  # HF-exact presets stay fp32
    assert resolve_dtype("bfloat16", cpu, "float32") == torch.bfloat16


def test_bf16_matches_transformers_bf16(model_dir):
    prompt = Tokenizer(model_dir).encode(PROMPT)
    ids = _hf_bf16_greedy(model_dir, prompt)
    runner = ModelRunner(EngineConfig(model=str(model_dir), dtype="bfloat16", block_size=8))
    assert runner.dtype == torch.bfloat16
    if can_pack(torch.bfloat16, torch.device("cpu")):
        assert isinstance(runner.model.layers[0].self_attn.qkv_proj, PackedLinear)
    ours = _our_logits(runner, ids, len(prompt))
    hf_bf16 = _hf_logits(model_dir, ids, torch.bfloat16)
    hf_fp32 = _hf_logits(model_dir, ids, torch.float32)
    assert ours.shape == hf_bf16.shape
    noise = (hf_bf16 - hf_fp32).abs().amax(-1)  # transformers' own bf16 error per position
    scale = hf_fp32.abs().amax(-1).clamp(min=1.0)
    bound = 2 * noise + 2 * BF16_ULP * scale
    err = (ours - hf_bf16).abs().amax(-1)
    assert (err <= bound).all(), (err / bound).max().item()
    top2 = hf_bf16.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > bound
    same = ours.argmax(-1) == hf_bf16.argmax(-1)
    assert same[clear].all()
    assert same.float().mean().item() >= 0.9
    assert clear.float().mean().item() >= 0.5  # the check is not vacuous
