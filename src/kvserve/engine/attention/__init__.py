"""Paged attention backends and the per-step metadata they consume.

KV cache layout (shared by runner, attention and offloading): one tensor
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; block 0 is the null block.

Backends: ``native`` (the C/OpenMP kernel reading K/V in place, CPU, when built) and ``torch``
(torch ops, CPU and CUDA; the fallback and the tests' oracle). ``auto`` picks native on CPUs
where its fast paths run (AVX-512; head dims 64/96/128, torch for the others), else torch.
The environment variable ``KVSERVE_ATTENTION_BACKEND`` (auto | native | torch) overrides
``auto``, e.g. to run the whole test suite on the torch backend.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kvserve.engine.attention.metadata import AttentionMetadata, PrefillInfo
from kvserve.engine.attention.native_backend import AVAILABLE as NATIVE_AVAILABLE
from kvserve.engine.attention.native_backend import FAST as NATIVE_FAST
from kvserve.engine.attention.native_backend import NativeAttentionBackend
from kvserve.engine.attention.torch_backend import TorchAttentionBackend

AttentionBackend = TorchAttentionBackend | NativeAttentionBackend
BACKEND_NAMES = ("auto", "native", "torch")


def get_attention_backend(
    device: str | torch.device = "cpu", name: str | None = None
) -> AttentionBackend:
    """The backend ``name`` for ``device``; ``None`` / ``auto`` defer to
    ``$KVSERVE_ATTENTION_BACKEND`` when set. ``native`` raises when the kernel was not built
    or the device is not a CPU."""
    if name in (None, "auto"):
        name = os.environ.get("KVSERVE_ATTENTION_BACKEND") or "auto"
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
    on_cpu = torch.device(device).type == "cpu"
    if name == "native":
        if not on_cpu:
            raise ValueError("the native attention backend runs on CPU only")
        return NativeAttentionBackend()  # raises when not built
    if name == "auto" and on_cpu and NATIVE_FAST:
        return NativeAttentionBackend(fast_only=True)
    return TorchAttentionBackend()


def set_attention_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Make every attention module of ``model`` (those holding a backend) use ``backend``."""
    if hasattr(model, "attn_backend"):
        model.attn_backend = backend
    for module in model.modules():
        if isinstance(getattr(module, "backend", None), AttentionBackend):
            module.backend = backend


__all__ = [
    "BACKEND_NAMES",
    "NATIVE_AVAILABLE",
    "NATIVE_FAST",
    "AttentionBackend",
    "AttentionMetadata",
    "NativeAttentionBackend",
    "PrefillInfo",
    "TorchAttentionBackend",
    "get_attention_backend",
    "set_attention_backend",
]
