"""Model hyper-parameters parsed from a Hugging Face ``config.json`` (Llama family only).

Owns the mapping from the HF field names of LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM and Qwen3ForCausalLM to one :class:`ModelConfig`; never touches weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass
class ModelConfig:
    """Everything the Llama-family module needs to build itself."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: always)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"
    model_type: str = "llama"
    sliding_window: int | None = None

    @property
    def max_context_len(self) -> int:
        """Longest sequence this implementation computes exactly."""
        return min(self.max_position_embeddings, self.sliding_window or 1 << 62)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"kvserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers 5 folds rope_theta into `rope_parameters`.
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (llama3, linear)")
            rope_scaling["rope_type"] = kind
            if kind == "default":
                rope_scaling = None
        # Sliding-window attention is not implemented; it equals full attention up to the
        # window, so the runner caps the context length there (Mistral v0.1: 4096).
        sliding_window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" or arch == "Qwen3ForCausalLM":
            sliding_window = sliding_window if cfg.get("use_sliding_window") else None
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            torch_dtype=str(dtype).replace("torch.", ""),
            model_type=str(cfg.get("model_type", "llama")),
            sliding_window=int(sliding_window) if sliding_window else None,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
        cfg = cls.from_dict(json.loads(path.read_text()))
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():  # generation_config's eos list wins (instruct models end turns there)
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                cfg.eos_token_id = [eos] if isinstance(eos, int) else list(eos)
        return cfg
