"""Projections packed for oneDNN give bitwise the outputs of ``F.linear`` (CPUs with native
bf16 only: elsewhere nothing is packed, which the last test checks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine.attention import AttentionMetadata
from kvserve.model.loader import load_model
from kvserve.model.packed_linear import PackedLinear, can_pack

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(
    not can_pack(torch.bfloat16, CPU), reason="this CPU has no native bf16 (nothing is packed)"
)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bitwise_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(384, 160, generator=g).bfloat16()
    b = torch.randn(384, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 160, generator=g).bfloat16()
    layer = PackedLinear(w, b)
    assert torch.equal(layer(x), F.linear(x, w, b))
    assert torch.equal(layer(x[:, ::1].t().contiguous().t()), F.linear(x, w, b))  # any strides
    assert layer(x.view(1, rows, 160)).shape == (1, rows, 384)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    cfg = model.config
    kv = torch.zeros(8, cfg.num_hidden_layers, 2, 16, cfg.num_key_value_heads, cfg.head_dim)
    meta = AttentionMetadata.build(
        block_size=16, query_lens=[len(ids)], num_computed=[0], block_tables=[[3, 5]]
    )
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), meta, kv.bfloat16()))


@needs_bf16
def test_packed_model_equals_unpacked(tiny_qwen2_model_dir):
    """Qwen2: q/k/v biases and a tied LM head (packed as a copy of the embedding)."""
    packed = load_model(tiny_qwen2_model_dir, dtype="bfloat16", device="cpu")
    plain = load_model(tiny_qwen2_model_dir, dtype="bfloat16", device="cpu", pack=False)
    attn = packed.layers[0].self_attn
    assert isinstance(attn.qkv_proj, PackedLinear) and attn.qkv_proj.bias is not None
    assert isinstance(packed.lm_head, PackedLinear) and plain.lm_head is None
    ids = torch.arange(3, 27)
    assert torch.equal(_logits(packed, ids), _logits(plain, ids))


def test_fp32_is_never_packed(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype="float32", device="cpu")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert not can_pack(torch.float32, CPU)
