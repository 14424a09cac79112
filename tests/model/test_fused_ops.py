"""The one-pass C ops (``kvserve.model.fused_ops``) against the torch ops they replace, which
round like Hugging Face's (the oracle here)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from kvserve.model import fused_ops
from kvserve.model.llama import apply_rope

# Built by `pip install -e .` wherever there is a C compiler: a missing extension there is a bug.
pytestmark = pytest.mark.skipif(
    not fused_ops.AVAILABLE and shutil.which("cc") is None, reason="no C compiler"
)
DTYPES = [torch.float32, torch.bfloat16]


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def assert_within_one_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: a few ulp (a sum or exp computed in another order / polynomial); bf16: the same
    fp32 difference can only flip a rounding, so at most one bf16 ulp (2^-7 relative) and
    almost every element bitwise equal."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-6)
        assert (out == ref).float().mean().item() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_is_bitwise_apply_rope(dtype):
    """In place on q and k as they sit in a QKV projection's output (strided rows), bit for bit
    what ``apply_rope`` (itself bitwise HF) returns; v untouched."""
    torch.manual_seed(0)
    t, hq, hkv, d = 37, 12, 4, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    ang = torch.randn(t, 1, d // 2) * 10
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    ref = apply_rope(qk, cos, sin)
    assert fused_ops.rope_(qk, cos, sin) is qk
    assert torch.equal(qk, ref)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 768: split across threads
def test_rms_norm_with_residual(dtype, rows):
    """``x += residual`` bitwise (the residual stream), then HF's RMSNorm of the sum."""
    torch.manual_seed(rows)
    x = (torch.randn(rows, 768) * 3).to(dtype)
    res = torch.randn(rows, 768).to(dtype)
    w = (torch.rand(768) + 0.5).to(dtype)
    stream = x + res
    out = fused_ops.rms_norm(x, w, 1e-6, res)
    assert torch.equal(x, stream)
    assert_within_one_rounding(out, hf_rms_norm(stream, w, 1e-6))
    assert_within_one_rounding(fused_ops.rms_norm(stream, w, 1e-5), hf_rms_norm(stream, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(1)
    gate_up = (torch.randn(64, 2 * 2304) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([-200.0, -88.0, -20.0, 0.0, 20.0, 100.0])  # exp's edges
    ref = F.silu(gate_up[:, :2304]).mul_(gate_up[:, 2304:])
    assert_within_one_rounding(fused_ops.silu_and_mul(gate_up), ref)


def test_threads_give_identical_results():
    """Rows are split across OpenMP threads, each computed whole by one: the thread count
    cannot change a bit."""
    torch.manual_seed(2)
    x, w = torch.randn(512, 768), torch.rand(768)
    gate_up = torch.randn(512, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_ops.rms_norm(x, w, 1e-6), fused_ops.silu_and_mul(gate_up)
        torch.set_num_threads(2)
        two = fused_ops.rms_norm(x, w, 1e-6), fused_ops.silu_and_mul(gate_up)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_other_inputs_take_the_torch_ops():
    """fp16, per-head (3-d) norms and a strided last dim go to the torch ops, same results."""
    x = torch.randn(6, 4, 32)
    w = torch.rand(32)
    assert torch.equal(fused_ops.rms_norm(x, w, 1e-6), hf_rms_norm(x, w, 1e-6))
    h = torch.randn(5, 64).half()
    wh = torch.rand(64).half()
    assert torch.equal(fused_ops.rms_norm(h, wh, 1e-6), hf_rms_norm(h, wh, 1e-6))
    gu = torch.randn(64, 6).t()  # last-dim stride 6
    assert torch.equal(fused_ops.silu_and_mul(gu), F.silu(gu[:, :32]) * gu[:, 32:])
