"""Weight loading from a local Hugging Face directory into :class:`LlamaForCausalLM`.

Owns the HF-name -> fused-parameter mapping (q/k/v -> ``qkv_proj``, gate/up ->
``gate_up_proj``) and dtype/device placement. Reads ``model.safetensors`` or the shards listed
in ``model.safetensors.index.json``; never downloads anything.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.model.config import ModelConfig
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.packed_linear import pack_linears
from kvserve.model.registry import get_model_class

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm;
    empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (x86: AVX512_BF16 or AMX-BF16; Arm:
    BF16), so bf16 GEMMs run at about 2x (AVX512_BF16) to 10x+ (AMX) the fp32 rate. Without
    them oneDNN emulates bf16 with fp32 FMAs plus conversions, slower than plain fp32."""
    flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & flags)


def cpu_has_native_fp16() -> bool:
    """True when the CPU multiplies fp16 in hardware (AVX512_FP16 or AMX-FP16)."""
    return bool({"avx512_fp16", "amx_fp16"} & cpu_flags())


def resolve_dtype(
    dtype: str | torch.dtype, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """The compute dtype for ``dtype`` on ``device``.

    ``auto``: on CUDA bf16 (fp16 on GPUs without bf16); on CPU bf16 where the CPU has native
    bf16 (:func:`cpu_has_native_bf16`), else fp32. On CPU a float32 checkpoint
    (``checkpoint_dtype``, the config's ``torch_dtype``) stays fp32, as transformers'
    ``dtype="auto"`` keeps it: weights published in fp32 are not rounded behind the user's
    back (the tiny test presets are fp32 and compared exactly with transformers)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if checkpoint_dtype in ("float32", "fp32"):
            return torch.float32
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no GPU")
    return dev


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ValueError(f"no safetensors weights in {model_dir}")
    return found


def _target(name: str, config: ModelConfig) -> tuple[str, slice | None] | None:
    """Our parameter name and the rows of it that HF tensor ``name`` fills (None: skip)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if "rotary_emb" in name:
        return None
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    fused = {
        "self_attn.q_proj.": ("self_attn.qkv_proj.", slice(0, q)),
        "self_attn.k_proj.": ("self_attn.qkv_proj.", slice(q, q + kv)),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", slice(q + kv, q + 2 * kv)),
        "mlp.gate_proj.": ("mlp.gate_up_proj.", slice(0, inter)),
        "mlp.up_proj.": ("mlp.gate_up_proj.", slice(inter, 2 * inter)),
    }
    for hf, (ours, rows) in fused.items():
        if hf in name:
            return name.replace(hf, ours), rows
    return name, None


@torch.inference_mode()
def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    config: ModelConfig | None = None,
    pack: bool = True,
) -> LlamaForCausalLM:
    """Build the model for ``model_dir`` and fill every parameter from its safetensors.

    ``pack``: on CPUs with native bf16 (fp16), bf16 (fp16) projections are packed for oneDNN
    (:mod:`kvserve.model.packed_linear`); fp32 models are never packed."""
    model_dir = Path(model_dir)
    config = config or ModelConfig.from_pretrained(model_dir)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev, config.torch_dtype)
    with torch.device("meta"):
        model = get_model_class(config)(config)
    model = model.to_empty(device=dev).to(torch_dtype)
    params = dict(model.named_parameters())
    mapper = getattr(model, "hf_weight_target", None)  # models with their own name mapping
    filled: dict[str, int] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                src_rows = None  # MoE: the local experts of a stacked HF tensor
                if mapper is not None:
                    target = mapper(hf_name)
                    if target is not None:
                        target, src_rows = target[:2], target[2]
                else:
                    target = _target(hf_name, config)
                if target is None:
                    continue
                name, rows = target
                if name not in params:
                    raise ValueError(f"unexpected weight {hf_name!r} in {path.name}")
                dst = params[name] if rows is None else params[name][rows]
                src = f.get_tensor(hf_name) if src_rows is None else f.get_slice(hf_name)[src_rows]
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(
                        f"weight {hf_name!r} has shape {tuple(src.shape)}, "
                        f"expected {tuple(dst.shape)}"
                    )
                dst.copy_(src)
                filled[name] = filled.get(name, 0) + dst.numel()
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {missing[:8]}")
    if pack:
        pack_linears(model)
    return model.eval()
