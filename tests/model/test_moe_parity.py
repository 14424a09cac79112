"""MoE models (Qwen3-MoE, Mixtral) token for token equal to transformers in fp32, with
prefix-cache hits and chunked prefill; loading from sharded and fused-expert checkpoints;
configs kvserve cannot compute exactly are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvserve import LLM
from kvserve.model.config import ModelConfig
from kvserve.model.moe import SparseMoeBlock
from kvserve.model.presets import make_model
from tests.engine.test_llm_parity import HFOracle, _assert_idle, _greedy, _prompts, _vocab


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-mixtral"])
def setup(request, tmp_path_factory):
    d = str(make_model(tmp_path_factory.mktemp(request.param), preset=request.param))
    return d, HFOracle(d)


def test_greedy_prefix_hits_and_chunked_prefill_match_hf(setup):
    d, hf = setup
    llm = LLM(d, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=24)
    vocab = _vocab(llm)
    shared = _prompts(3, 1, 60, 60, vocab)[0]
    prompts = [*_prompts(1, 3, 5, 70, vocab), shared]
    outs = llm.generate(prompts, _greedy())  # chunked: 24 tokens per step across requests
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf.greedy(p)
    # Prefix-cache hits in a mixed batch.
    batch = [shared[:50] + [7, 8, 9], *_prompts(4, 2, 10, 40, vocab)]
    outs = llm.generate(batch, _greedy())
    assert outs[0].num_cached_tokens >= 48
    for p, o in zip(batch, outs, strict=True):
        assert o.outputs[0].token_ids == hf.greedy(p)
    _assert_idle(llm)
    # Every expert saw tokens, counted per layer (the /metrics source).
    load = llm.engine.runner.model.expert_load()
    assert sorted(load) == [0, 1, 2, 3]
    assert all(len(v) == 8 and sum(v) > 0 for v in load.values())


def test_experts_are_grouped_not_dense(setup, monkeypatch):
    """Each expert's GEMMs run once per layer on exactly the rows routed to it."""
    d, _ = setup
    llm = LLM(d, num_kv_blocks=64)
    seen: list[list[int]] = []
    orig = SparseMoeBlock.compute_experts

    def spy(self, rows, counts):
        seen.append(list(counts))
        assert rows.shape[0] == sum(counts)
        return orig(self, rows, counts)

    monkeypatch.setattr(SparseMoeBlock, "compute_experts", spy)
    llm.generate([[5, 6, 7]], _greedy())
    # Decode steps route 1 token to top_k=2 experts: 2 rows, not 8 experts x 1 token.
    assert seen and all(sum(c) % 2 == 0 for c in seen)
    assert any(sum(1 for n in c if n) == 2 for c in seen)


def test_sharded_fused_checkpoint_loads_identically(setup, tmp_path):
    """transformers 5's in-memory layout (stacked ``experts.gate_up_proj``) over two shards."""
    d, _ = setup
    with safe_open(f"{d}/model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    mc = ModelConfig.from_pretrained(d)
    fused: dict[str, torch.Tensor] = {}
    moe = "block_sparse_moe" if mc.architecture == "MixtralForCausalLM" else "mlp"
    names = (
        ("w1", "w3", "w2") if moe == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")
    )
    for k, v in tensors.items():
        if ".experts." not in k:
            fused[k.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = v
    for i in range(mc.num_hidden_layers):
        p = f"model.layers.{i}.{moe}.experts."
        gate_up = [
            torch.cat([tensors[f"{p}{e}.{names[0]}.weight"], tensors[f"{p}{e}.{names[1]}.weight"]])
            for e in range(mc.num_experts)
        ]
        down = [tensors[f"{p}{e}.{names[2]}.weight"] for e in range(mc.num_experts)]
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(down)
    out = tmp_path / "fused"
    out.mkdir()
    keys = sorted(fused)
    shards = {"a.safetensors": keys[::2], "b.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: fused[k].contiguous() for k in ks}, str(out / name))
    index = {"weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((Path(d) / f).read_bytes())
    p = _prompts(9, 1, 30, 30, 1000)[0]
    a = LLM(d, num_kv_blocks=64).generate([p], _greedy())[0].outputs[0].token_ids
    b = LLM(str(out), num_kv_blocks=64).generate([p], _greedy())[0].outputs[0].token_ids
    assert a == b


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"shared_expert_intermediate_size": 64}, "shared experts"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
)
def test_unsupported_moe_configs_are_refused(change, message):
    from kvserve.model.presets import model_config

    cfg = model_config("tiny-moe")
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(cfg)
