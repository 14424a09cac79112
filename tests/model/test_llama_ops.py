"""Model building blocks that must round exactly like Hugging Face's."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.llama import apply_rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_is_bitwise_hf(dtype):
    """Halves-based RoPE == HF's ``x * cos + rotate_half(x) * sin`` bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(7, 4, 16).to(dtype)
    ang = torch.randn(7, 1, 8)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    ref = x * torch.cat([cos, cos], -1) + torch.cat([-x2, x1], -1) * torch.cat([sin, sin], -1)
    assert torch.equal(apply_rope(x, cos, sin), ref)
