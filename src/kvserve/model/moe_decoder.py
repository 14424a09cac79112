"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral.

Both are the Llama-family decoder (attention, norms, RoPE reused from
:mod:`kvserve.model.llama`; Qwen3-MoE's per-head q/k norm is the Qwen3 switch) with the MLP of
sparse layers replaced by :class:`kvserve.model.moe.SparseMoeBlock`. Owns the mapping of HF's
per-expert weight names (``mlp.experts.{e}.{gate,up,down}_proj`` for Qwen3-MoE,
``block_sparse_moe.experts.{e}.w{1,3,2}`` for Mixtral, and transformers 5's fused
``mlp.experts.{gate_up,down}_proj``) onto the local experts' stacked tensors.
"""

from __future__ import annotations

import re

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.moe import SparseMoeBlock

_EXPERT = re.compile(
    r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_FUSED = re.compile(r"^(layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")

Index = tuple[int | slice, ...] | slice | None


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM / MixtralForCausalLM: a Llama-family decoder whose sparse layers
    (``config.is_moe_layer``) have a :class:`SparseMoeBlock` as ``mlp``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.layers):
            if config.is_moe_layer(i):
                layer.mlp = SparseMoeBlock(config)

    def moe_blocks(self) -> list[tuple[int, SparseMoeBlock]]:
        return [(i, m.mlp) for i, m in enumerate(self.layers) if isinstance(m.mlp, SparseMoeBlock)]

    def expert_load(self) -> dict[int, list[int]]:
        """``{layer: tokens routed to each expert since start}``."""
        return {i: b.expert_tokens.tolist() for i, b in self.moe_blocks()}

    @torch.inference_mode()
    def dummy_moe_step(self) -> None:
        """Take part in every MoE layer's collectives with zero tokens (an expert-parallel
        rank with nothing scheduled while another rank computes)."""
        for _, block in self.moe_blocks():
            w = block.gate.weight
            block(torch.empty((0, w.shape[1]), dtype=w.dtype, device=w.device))

    def hf_weight_target(self, hf_name: str) -> tuple[str, Index, Index] | None:
        """``(our parameter, rows of it to fill, rows of the HF tensor to take)`` for one HF
        tensor; None: not ours (another rank's expert, rotary buffers)."""
        from kvserve.model.loader import _target

        name = hf_name[len("model.") :] if hf_name.startswith("model.") else hf_name
        if m := _ROUTER.match(name):
            return f"{m[1]}.mlp.gate.weight", None, None
        block = None
        if m := _EXPERT.match(name) or _FUSED.match(name):
            block = self.get_submodule(f"{m[1]}.mlp")
        if block is None or not isinstance(block, SparseMoeBlock):
            target = _target(hf_name, self.config)
            return None if target is None else (target[0], target[1], None)
        inter, lo, hi = block.intermediate_size, block.expert_start, block.expert_end
        if m.re is _FUSED:
            return f"{m[1]}.mlp.{'w13' if m[2] == 'gate_up_proj' else 'w2'}", None, slice(lo, hi)
        e = int(m[2])
        if not lo <= e < hi:
            return None
        kind = m[3]
        if kind in ("down_proj", "w2"):
            return f"{m[1]}.mlp.w2", (e - lo,), None
        rows = slice(0, inter) if kind in ("gate_proj", "w1") else slice(inter, 2 * inter)
        return f"{m[1]}.mlp.w13", (e - lo, rows), None
