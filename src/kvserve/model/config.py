"""Model hyper-parameters parsed from a Hugging Face ``config.json`` (Llama family, and the
Qwen3-MoE / Mixtral mixtures of experts).

Owns the mapping from the HF field names of LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM and MixtralForCausalLM to one
:class:`ModelConfig` (refusing MoE variants kvserve does not compute); never touches weights.
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
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


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
    # Mixture of experts (Qwen3-MoE, Mixtral); num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen3-MoE's rule: sparse unless listed in ``mlp_only_layers`` or off the step."""
        return (
            self.is_moe
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

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
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            sliding_window = sliding_window if cfg.get("use_sliding_window") else None
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        moe = _moe_fields(arch, cfg)
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
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            torch_dtype=str(dtype).replace("torch.", ""),
            model_type=str(cfg.get("model_type", "llama")),
            sliding_window=int(sliding_window) if sliding_window else None,
            **moe,
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


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """MoE hyper-parameters of Qwen3-MoE / Mixtral; refuses what kvserve does not compute."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden_act {act!r} is not supported (silu only)")
    if arch == "MixtralForCausalLM":
        n = int(cfg["num_local_experts"])
        fields = dict(moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    else:
        n = int(cfg["num_experts"])
        for key in ("shared_expert_intermediate_size", "n_shared_experts"):
            if cfg.get(key):
                raise ValueError(f"{arch}: shared experts ({key}) are not supported")
        fields = dict(
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []],
        )
    k = int(cfg["num_experts_per_tok"])
    if not 0 < k <= n:
        raise ValueError(f"{arch}: num_experts_per_tok {k} must be in [1, num_experts={n}]")
    return dict(num_experts=n, num_experts_per_tok=k, **fields)
