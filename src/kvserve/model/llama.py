"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat token batch.

Variants are switches of one module: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied
embeddings, llama3 / linear RoPE scaling, sliding-window layers (Mistral; Qwen2/3 from
``max_window_layers``), which attend through the metadata's window view. Projections are
fused (QKV, gate-up) so a layer is four GEMMs. Attention goes through a paged backend from
``kvserve.engine.attention``; this module owns no KV state.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    get_attention_backend,
)
from kvserve.model import fused_ops
from kvserve.model.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight multiply (as HF does), in one
    pass on CPU (:mod:`kvserve.model.fused_ops`)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of ``x``; with ``residual``, of ``x += residual`` (in place, the same
        pass)."""
        return fused_ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with llama3 / linear scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a fp32 cos/sin table indexed by position (built on first use on
    the positions' device, so the module can be materialized from the meta device).

    ``cos_sin(positions, dtype)`` is looked up once per forward and shared by every layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def _build(self, device: torch.device) -> None:
        inv_freq = rope_inv_freq(self.config)
        t = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        emb = torch.outer(t, inv_freq).repeat(1, 2)
        self._cos, self._sin = emb.cos().to(device), emb.sin().to(device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, D/2]`` cos and sin (both halves of HF's table are equal) in ``dtype``."""
        if self._cos is None or self._cos.device != positions.device:
            self._build(positions.device)
        half = self.config.head_dim // 2
        cos = self._cos[positions, :half].unsqueeze(1).to(dtype)
        sin = self._sin[positions, :half].unsqueeze(1).to(dtype)
        return cos, sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on halves (same roundings as HF, no concat of
    ``rotate_half``): ``[x1 c - x2 s, x2 c + x1 s]``."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    o1.sub_(x2 * sin)
    torch.mul(x2, cos, out=o2)
    o2.add_(x1 * sin)
    return out


class Attention(nn.Module):
    """Fused QKV projection, optional per-head q/k norms (``norm``: the model's RMSNorm
    variant), RoPE, paged attention (windowed on sliding-window layers), output projection."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        backend: TorchAttentionBackend | None = None,
        *,
        norm: Callable[[int, float], nn.Module] = RMSNorm,
        qk_norm: bool | None = None,  # default: the config's (Qwen3)
        o_bias: bool = False,  # Qwen2 has QKV biases but none on o_proj
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.attn_scale
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        if config.qk_norm if qk_norm is None else qk_norm:
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.backend = backend or get_attention_backend()
        self.window = config.layer_window(layer_idx)  # sliding window (tokens) or None
        # Where this layer's KV lives: its KV cache group (whose metadata it reads) and its
        # slot in that group's blocks (set by the model runner; default: one group).
        self.kv_group, self.kv_slot = 0, layer_idx

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, d)
        cos, sin = cos_sin
        if self.q_norm is None:
            # q and k side by side in each row: one RoPE over their heads together, in place in
            # the QKV output (q and k stay views of it, as the backends accept).
            qk = fused_ops.rope_(qkv[:, :qk_size].view(t, h + self.num_kv_heads, d), cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(t, h, d))
            k = self.k_norm(qkv[:, self.q_size : qk_size].view(t, self.num_kv_heads, d))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = windowed_attention(self.backend, self.window, q, k, v, kv_cache[:, self.kv_slot],
                               meta.for_group(self.kv_group), self.scale)  # fmt: skip
        return self.o_proj(o.reshape(t, self.q_size))


def windowed_attention(
    backend: TorchAttentionBackend,
    window: int | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``backend.forward``, or for a sliding-window layer the torch backend (the native and
    FlashInfer backends' ``fallback``; they do not take a window) over ``meta``'s window
    view."""
    if window is None:
        return backend.forward(q, k, v, kv_layer, meta, scale)
    torch_backend = backend if backend.name == "torch" else backend.fallback
    return torch_backend.forward(q, k, v, kv_layer, meta.window_view(window), scale)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, backend: TorchAttentionBackend | None = None
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, backend)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        # Residuals added into the sublayers' fresh outputs (no new [T, hidden] buffers); the
        # first in the same pass as the norm that follows it.
        h = self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache)
        return self.mlp(self.post_attention_layernorm(h, residual=x)).add_(h)


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. Parameter names follow HF except the fused ``qkv_proj`` and
    ``gate_up_proj`` (the loader maps them)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # One backend for all layers: its gather workspace is reused layer after layer.
        self.attn_backend = get_attention_backend()
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.attn_backend) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
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
        """``input_ids``/``positions`` ``[T]`` -> final-normed hidden states ``[T, hidden]``.

        ``kv_cache``: ``[num_blocks, layers_per_group, 2, block_size, H_kv, D]`` (one slot
        per layer of a KV cache group: every layer with one group); this step's K/V
        are written into it at ``attn_metadata.slot_mapping``."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos_sin, attn_metadata, kv_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` in the model dtype."""
        if self.lm_head is None:  # tied embeddings (unless packed: then a packed copy)
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)
