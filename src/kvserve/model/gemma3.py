"""Gemma 3 text decoder (``Gemma3ForCausalLM``, model_type ``gemma3_text``) over a flat batch.

Its differences from the Llama family: embeddings scaled by sqrt(hidden); RMSNorm computed
in fp32 with ``(1 + weight)``; RMSNorm on each q/k head; norms before *and* after attention
and MLP; gelu-tanh MLP; scores scaled by ``query_pre_attn_scalar ** -0.5``; sliding-window
layers (every layer but each 6th by default) with their own RoPE base (local 10k vs global
1M); optional tanh soft-capping of the final logits. Projections are fused (QKV, gate-up)
under the same names as :mod:`kvserve.model.llama`, so the loader's name mapping applies.
Attention goes through a paged backend; windowed layers read the metadata's window view.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    get_attention_backend,
)
from kvserve.model.config import ModelConfig
from kvserve.model.llama import Attention, RotaryEmbedding


class GemmaRMSNorm(nn.Module):
    """RMSNorm in fp32 times ``(1 + weight)``, cast back at the end (as HF's Gemma3RMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, backend: TorchAttentionBackend | None = None
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(
            config,
            layer_idx,
            backend,
            norm=GemmaRMSNorm,
            qk_norm=True,
            o_bias=config.attention_bias,
        )
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache)
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(nn.Module):
    """Decoder + LM head (tied to the embeddings unless the checkpoint has ``lm_head``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.attn_backend = get_attention_backend()
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, self.attn_backend)
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)  # full-attention layers
        local = dataclasses.replace(
            config, rope_theta=config.rope_local_theta or config.rope_theta, rope_scaling=None
        )
        self.rotary_emb_local = RotaryEmbedding(local)  # sliding-window layers
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final-normed hidden states ``[T, hidden]``."""
        x = self.embed_tokens(input_ids)
        # HF multiplies by the fp32 scalar cast to the weights' dtype.
        x = x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)
        cos_sin_local = self.rotary_emb_local.cos_sin(positions, x.dtype)
        for layer in self.layers:
            local = layer.self_attn.window is not None
            x = layer(x, cos_sin_local if local else cos_sin, attn_metadata, kv_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` in the model dtype, soft-capped when configured."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
