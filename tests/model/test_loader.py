"""Presets are deterministic; weights load from single or sharded safetensors; config parsing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.model.presets import make_model


def test_make_model_is_deterministic(tiny_model_dir, tmp_path):
    again = make_model(tmp_path / "again", "tiny")
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_sharded_checkpoint_and_dtypes(tiny_model_dir, tmp_path):
    ref = load_model(tiny_model_dir, dtype="float32", device="cpu")
    tensors = load_file(tiny_model_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
        weight_map.update({k: shard for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    sharded = load_model(tmp_path, dtype="float32", device="cpu")
    for (n1, p1), (n2, p2) in zip(ref.named_parameters(), sharded.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    # Fused q/k/v rows come from the right HF tensors.
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(ref.layers[1].self_attn.qkv_proj.weight[: q.shape[0]], q)
    bf16 = load_model(tmp_path, dtype="bfloat16", device="cpu")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    # A missing tensor is an error, not silently uninitialized memory.
    del weight_map[names[0]]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "model-00001-of-00002.safetensors").unlink()
    save_file(
        {k: tensors[k] for k in names[2::2]}, str(tmp_path / "model-00001-of-00002.safetensors")
    )
    with pytest.raises(ValueError, match="missing"):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_config_variants():
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=100,
    )
    c = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert c.attention_bias and not c.qk_norm and c.head_dim == 16
    assert c.num_key_value_heads == 4
    c = ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert c.qk_norm and c.head_dim == 32 and c.q_size == 128
    c = ModelConfig.from_dict(
        {
            **base,
            "architectures": ["LlamaForCausalLM"],
            "eos_token_id": [1, 2],
            "rope_scaling": {
                "type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
            },
        }
    )
    assert c.rope_scaling["rope_type"] == "llama3" and c.eos_token_id == [1, 2]
    c = ModelConfig.from_dict(
        {
            **base,
            "architectures": ["MistralForCausalLM"],
            "sliding_window": 4096,
            "max_position_embeddings": 32768,
        }
    )
    # Sliding-window attention is computed (every Mistral layer), so the context is not capped.
    assert c.max_context_len == 32768 and c.layer_window(1) == 4096
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        ModelConfig.from_dict({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig.from_dict(
            {
                **base,
                "architectures": ["LlamaForCausalLM"],
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
            }
        )
