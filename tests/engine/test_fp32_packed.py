"""fp32 engines run their projections through oneDNN's packed GEMM (the model runner packs
them after ``load_model``, which keeps torch's BLAS GEMM, bitwise what transformers runs):
another summation order, so close to the plain model, not bitwise."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.attention import AttentionMetadata
from kvserve.engine.model_runner import ModelRunner
from kvserve.model.loader import load_model
from kvserve.model.packed_linear import PackedLinear, can_pack

CPU = torch.device("cpu")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    cfg = model.config
    kv = torch.zeros(8, cfg.num_hidden_layers, 2, 16, cfg.num_key_value_heads, cfg.head_dim)
    meta = AttentionMetadata.build(
        block_size=16, query_lens=[len(ids)], num_computed=[0], block_tables=[[3, 5]]
    )
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), meta, kv))


@pytest.mark.skipif(not can_pack(torch.float32, CPU, fp32=True), reason="no oneDNN in torch")
def test_fp32_runner_packs_and_stays_close(tiny_model_dir):
    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu"))
    plain = load_model(tiny_model_dir, dtype="float32", device="cpu")
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    layer = runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear)
    assert isinstance(layer.mlp.down_proj, PackedLinear)
    ids = torch.arange(3, 27)
    ours, ref = _logits(runner.model, ids), _logits(plain, ids)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
