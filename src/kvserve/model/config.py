"""Model hyper-parameters parsed from a Hugging Face ``config.json`` (Llama family, Gemma 3
text, and the Qwen3-MoE / Mixtral mixtures of experts).

Owns the mapping from the HF field names of LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM and
Gemma3ForCausalLM to one :class:`ModelConfig` (refusing variants kvserve does not compute),
including each layer's attention type (full, or sliding window of ``sliding_window`` tokens);
never touches weights.
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
    "Gemma3ForCausalLM",
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
    # Attention type per layer ("full_attention" | "sliding_attention"; empty: all full).
    # A sliding layer's query at position p attends keys (p - sliding_window, p].
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    # Gemma 3: scores scaled by query_pre_attn_scalar ** -0.5; sliding layers' RoPE base;
    # tanh soft-capping of the final logits.
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None
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
        return self.max_position_embeddings

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` in tokens; None: full attention."""
        if not self.sliding_window or not self.layer_types:
            return None
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @property
    def attn_scale(self) -> float:
        """Softmax scale of the attention scores."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        sliding_window, layer_types = _attention_types(arch, cfg)
        gemma = _gemma3_fields(cfg) if arch == "Gemma3ForCausalLM" else {}
        if gemma:
            rope_theta, rope_scaling = gemma.pop("rope_theta"), gemma.pop("rope_scaling")
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
            sliding_window=sliding_window,
            layer_types=layer_types,
            **gemma,
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


def _attention_types(arch: str, cfg: dict[str, Any]) -> tuple[int | None, list[str]]:
    """``(sliding_window, layer_types)``: HF's rules per architecture. Mistral/Mixtral slide in
    every layer when ``sliding_window`` is set; elsewhere an explicit ``layer_types``
    (transformers 5 writes it) wins, else Qwen2/3 only with ``use_sliding_window`` and from layer
    ``max_window_layers`` on, Gemma 3 every layer but each ``sliding_window_pattern``-th."""
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        window = window if cfg.get("use_sliding_window") else None
    if arch == "LlamaForCausalLM" or not window:
        return None, ["full_attention"] * n
    # HF's Mistral and Mixtral slide in every layer whatever layer_types says.
    types = (
        cfg.get("layer_types") if arch not in ("MistralForCausalLM", "MixtralForCausalLM") else None
    )
    if types is None:
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            first = int(cfg.get("max_window_layers", n))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        elif arch == "Gemma3ForCausalLM":
            every = int(cfg.get("sliding_window_pattern", 6))
            types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                     for i in range(n)]  # fmt: skip
        else:
            types = ["sliding_attention"] * n
    types = [str(t) for t in types]
    if len(types) != n or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"{arch}: layer_types must list full_attention/sliding_attention for each of the "
            f"{n} layers"
        )
    if int(window) < 1:
        raise ValueError(f"{arch}: sliding_window must be >= 1, got {window}")
    return int(window), types


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 text: scale, RoPE bases per attention type, soft-capping; refuses what kvserve
    does not compute (attention-score soft-capping, bidirectional attention, other
    activations)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma3ForCausalLM: hidden_activation {act!r} is not supported")
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("Gemma3ForCausalLM: attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma3ForCausalLM: use_bidirectional_attention is not supported")
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    theta = full.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0
    local_theta = local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0
    scaling = cfg.get("rope_scaling") or (full if "factor" in full else None)
    if local.get("rope_type", "default") != "default":
        raise ValueError("Gemma3ForCausalLM: scaled RoPE on sliding layers is not supported")
    if scaling is not None:
        scaling = dict(scaling)
        scaling["rope_type"] = kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear"):
            raise ValueError(f"Gemma3ForCausalLM: rope_type {kind!r} is not supported (linear)")
        scaling = None if kind == "default" else scaling
    softcap = cfg.get("final_logit_softcapping")
    return dict(
        rope_theta=float(theta),
        rope_scaling=scaling,
        rope_local_theta=float(local_theta),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        final_logit_softcapping=float(softcap) if softcap else None,
    )


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
