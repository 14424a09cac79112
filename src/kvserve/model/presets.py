"""`kvserve make-model`: write a deterministic Hugging Face-format model directory.

Owns the preset shapes (``tiny`` for tests, ``small`` for benchmarks, ``tiny-qwen2``, the
mixtures of experts ``tiny-moe`` / ``small-moe`` (Qwen3-MoE) and ``tiny-mixtral``, the
sliding-window models ``tiny-mistral-sw`` and ``tiny-gemma3`` (windows of a few blocks, so
tests cross them)), the
seeded random initialization, and the byte-level BPE tokenizer trained locally from
:mod:`kvserve.model.corpus`. Same arguments -> same bytes, on every run and machine. The
directory loads in kvserve and in ``transformers`` alike (the parity oracle).
"""

from __future__ import annotations

import argparse
import json
import zlib
from functools import cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

BOS, EOS, PAD = "<|begin_of_text|>", "<|eot|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS]

# Rendered text carries no BOS: ``Tokenizer.encode`` adds it, so encode(render(...)) has one.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + text + '<|eot|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        arch="llama",
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,  # target of BPE training; the result is what the corpus supports
        max_position_embeddings=2048,
        torch_dtype="float32",
    ),
    "small": dict(
        arch="llama",
        hidden_size=768,
        intermediate_size=2304,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    ),
}
PRESETS["tiny-qwen2"] = dict(PRESETS["tiny"], arch="qwen2")
# Mixtures of experts (same tokenizer as tiny): 8 experts, top-2.
PRESETS["tiny-moe"] = dict(
    PRESETS["tiny"],
    arch="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
)
PRESETS["tiny-mixtral"] = dict(
    PRESETS["tiny"],
    arch="mixtral",
    intermediate_size=256,
    num_local_experts=8,
    num_experts_per_tok=2,
)
PRESETS["small-moe"] = dict(
    PRESETS["small"],
    arch="qwen3_moe",
    num_hidden_layers=8,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=768,
    torch_dtype="float32",
)

# Sliding windows: Mistral-style (every layer), Gemma 3 (5 sliding layers : 1 full).
PRESETS["tiny-mistral-sw"] = dict(PRESETS["tiny"], arch="mistral", sliding_window=48)
PRESETS["tiny-gemma3"] = dict(
    PRESETS["tiny"], arch="gemma3", num_hidden_layers=6, sliding_window=32
)

ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rope_theta=500000.0,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        rope_theta=1000000.0,
        use_sliding_window=False,
        sliding_window=None,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        rope_theta=1000000.0,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        rope_theta=1000000.0,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        tie_word_embeddings=False,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
        output_router_logits=False,
    ),
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        # Local RoPE base for sliding layers, linearly scaled global base for full ones.
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=48,  # != head_dim, so a wrong score scale shows
        attention_bias=False,
        attn_logit_softcapping=None,
        final_logit_softcapping=30.0,
        sliding_window_pattern=6,
        tie_word_embeddings=True,
    ),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=False,
        router_jitter_noise=0.0,
        router_aux_loss_coef=0.02,
        output_router_logits=False,
    ),
}


# --------------------------------------------------------------------------------------------
# Tokenizer


@cache
def _tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE (deterministic: single-threaded, fixed corpus)."""
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from kvserve.model.corpus import training_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok.to_str(pretty=True)


def _tokenizer_config(max_len: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }


# --------------------------------------------------------------------------------------------
# Weights


def _init_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """HF-named tensors. Projections ~ N(0, 1/fan_in) so every layer moves the residual stream
    (greedy text then depends on context instead of cycling on one token); norms and biases
    are perturbed so a wrongly mapped weight changes the output."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std + mean

    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nh
    arch = cfg["model_type"]
    # Tied embeddings double as the LM head: keep them small so the next token is not simply
    # the current one (the residual stream would otherwise be dominated by its embedding).
    emb_std = 0.02 if cfg["tie_word_embeddings"] else 1.0
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, h, std=emb_std)}
    gemma = arch == "gemma3_text"
    norm_mean = 0.0 if gemma else 1.0  # Gemma's norms multiply by (1 + weight)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = normal(h, std=0.1, mean=norm_mean)
        w[p + "post_attention_layernorm.weight"] = normal(h, std=0.1, mean=norm_mean)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = normal(h, std=0.1)
            w[p + "post_feedforward_layernorm.weight"] = normal(h, std=0.1)
        w[p + "self_attn.q_proj.weight"] = normal(nh * d, h, std=h**-0.5)
        w[p + "self_attn.k_proj.weight"] = normal(nkv * d, h, std=h**-0.5)
        w[p + "self_attn.v_proj.weight"] = normal(nkv * d, h, std=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = normal(h, nh * d, std=(nh * d) ** -0.5)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal(nh * d, std=0.1)
            w[p + "self_attn.k_proj.bias"] = normal(nkv * d, std=0.1)
            w[p + "self_attn.v_proj.bias"] = normal(nkv * d, std=0.1)
        if arch in ("qwen3", "qwen3_moe", "gemma3_text"):
            w[p + "self_attn.q_norm.weight"] = normal(d, std=0.1, mean=norm_mean)
            w[p + "self_attn.k_norm.weight"] = normal(d, std=0.1, mean=norm_mean)
        if arch in ("qwen3_moe", "mixtral"):
            w.update(_moe_weights(cfg, p, normal))
            continue
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "mlp.down_proj.weight"] = normal(h, inter, std=inter**-0.5)
    w["model.norm.weight"] = normal(h, std=0.1, mean=norm_mean)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(vocab, h, std=h**-0.5)
    return w


def _moe_weights(cfg: dict[str, Any], p: str, normal: Any) -> dict[str, torch.Tensor]:
    """Router and per-expert weights under HF's checkpoint names. The router is scaled up so
    that routing is decisive (distinct experts per token, not a near-uniform mix)."""
    h = cfg["hidden_size"]
    if cfg["model_type"] == "mixtral":
        n, inter, pre = cfg["num_local_experts"], cfg["intermediate_size"], "block_sparse_moe"
        names = ("w1", "w3", "w2")
    else:
        n, inter, pre = cfg["num_experts"], cfg["moe_intermediate_size"], "mlp"
        names = ("gate_proj", "up_proj", "down_proj")
    w = {f"{p}{pre}.gate.weight": normal(n, h, std=4 * h**-0.5)}
    for e in range(n):
        q = f"{p}{pre}.experts.{e}."
        w[q + names[0] + ".weight"] = normal(inter, h, std=h**-0.5)
        w[q + names[1] + ".weight"] = normal(inter, h, std=h**-0.5)
        w[q + names[2] + ".weight"] = normal(h, inter, std=inter**-0.5)
    return w


def model_config(preset: str = "tiny", arch: str | None = None) -> dict[str, Any]:
    """The ``config.json`` contents of a preset."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    shape = dict(PRESETS[preset])
    arch = arch or shape.pop("arch")
    shape.pop("arch", None)
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    cfg: dict[str, Any] = dict(ARCHS[arch])
    cfg.update(shape)
    if arch in ("qwen3", "qwen3_moe"):
        cfg["head_dim"] = 48  # explicit and != hidden / heads, as in real Qwen3 models
    else:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch == "llama":
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
    if arch == "gemma3":
        n, every = cfg["num_hidden_layers"], cfg["sliding_window_pattern"]
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)
        ]
    else:
        cfg["hidden_act"] = "silu"
    cfg.update(
        rms_norm_eps=1e-5 if arch in ("llama", "mistral", "mixtral") else 1e-6,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        attention_dropout=0.0,
        use_cache=True,
    )
    return dict(sorted(cfg.items()))


def make_model(out_dir: str | Path, preset: str = "tiny", arch: str | None = None) -> Path:
    """Write the preset as a HF-format directory at ``out_dir`` (created) and return it."""
    cfg = model_config(preset, arch)
    tokenizer_json = _tokenizer_json(cfg["vocab_size"])
    # The vocabulary is exactly the trained tokenizer's, so every sampled id decodes.
    cfg["vocab_size"] = len(json.loads(tokenizer_json)["model"]["vocab"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed = zlib.crc32(f"kvserve/{preset}/{cfg['model_type']}".encode())
    weights = _init_weights(cfg, seed)
    dtype = getattr(torch, cfg["torch_dtype"])
    weights = {k: v.to(dtype).contiguous() for k, v in weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    def dump(name: str, obj: Any) -> None:
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")

    dump("config.json", cfg)
    dump(
        "generation_config.json",
        {
            "bos_token_id": cfg["bos_token_id"],
            "eos_token_id": cfg["eos_token_id"],
            "pad_token_id": cfg["pad_token_id"],
        },
    )
    (out / "tokenizer.json").write_text(tokenizer_json)
    dump("tokenizer_config.json", _tokenizer_config(cfg["max_position_embeddings"]))
    return out


# --------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the model into")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument(
        "--arch", choices=sorted(ARCHS), default=None, help="default: the preset's architecture"
    )


def run(args: argparse.Namespace) -> int:
    out = make_model(args.out_dir, args.preset, args.arch)
    n = sum(1 for _ in out.iterdir())
    print(
        f"wrote {args.preset} ({model_config(args.preset, args.arch)['model_type']}) "
        f"to {out} ({n} files)"
    )
    return 0
