"""Linear layers whose weights are packed once for oneDNN: bf16 / fp16 on CPUs with native
units (at load), fp32 when the model runner asks (``pack_linears(model, fp32=True)``).

torch's bf16 ``F.linear`` on CPU calls oneDNN with the plain ``[out, in]`` weight, which oneDNN
reorders into its blocked layout on every call; for a decode step (a few activation rows) that
reorder is most of the time. Packing at load removes it (a decode GEMV here: 2x faster), with
outputs bitwise equal to ``F.linear``'s (the same oneDNN kernel runs). fp32 ``F.linear`` runs
torch's BLAS GEMM instead, which on the AMD EPYC dev box (AVX-512) took 1.75x oneDNN's packed
time at 2048 x 768 x 4608 (145 vs 83 ms, 1 thread) and 2x at 32 rows; packed fp32 sums in
another order (logits within ~1e-5 of transformers', inside the HF-parity tests' 2e-4), so
``load_model`` keeps torch's GEMM for fp32 (bitwise what transformers computes) and the engine's
model runner packs fp32 models after loading.
"""

from __future__ import annotations

import torch
from torch import nn

# Projections of the Llama-family modules packed by :func:`pack_linears` (by attribute name:
# the MoE router ``mlp.gate`` and the stacked expert weights stay plain tensors).
PACKED_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def can_pack(dtype: torch.dtype, device: torch.device, fp32: bool = False) -> bool:
    """Whether :class:`PackedLinear` serves ``dtype`` on ``device``: CPU, oneDNN built in, and
    a half type the CPU multiplies natively (emulated bf16 is slower than fp32), or fp32 when
    ``fp32`` is set."""
    from kvserve.model.loader import cpu_has_native_bf16, cpu_has_native_fp16

    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return cpu_has_native_bf16() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return cpu_has_native_fp16() and torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return fp32 and dtype == torch.float32


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in oneDNN's blocked layout (an opaque tensor: there is
    no ``weight`` attribute to read back)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_hint: int = 1
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch-size hint only picks the blocking; any number of rows runs.
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().clone(), persistent=False
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias, batch_hint(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed_weight, self.bias, "none", [], ""
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def batch_hint(dtype: torch.dtype) -> int:
    """oneDNN's batch-size hint for packing: 32 for fp32 (a 32-row decode GEMM 1.35x faster
    than with hint 1 on the dev box, 2048 rows the same), 1 for half types (no difference
    measured; their outputs are checked bitwise against ``F.linear`` with it)."""
    return 32 if dtype == torch.float32 else 1


@torch.inference_mode()
def pack_linears(model: nn.Module, fp32: bool = False) -> int:
    """Replace the projections named in :data:`PACKED_NAMES` of every submodule of ``model``
    by :class:`PackedLinear` when :func:`can_pack` allows it (``fp32``: fp32 models too; a tied
    LM head gets a packed copy of the embedding). Returns how many were packed; the plain
    weights are released."""
    emb = getattr(model, "embed_tokens", None)
    if emb is None or not can_pack(emb.weight.dtype, emb.weight.device, fp32):
        return 0
    count = 0
    for module in list(model.modules()):
        for name in PACKED_NAMES:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear.from_linear(child))
                count += 1
    if hasattr(model, "lm_head") and model.lm_head is None:  # tied embeddings
        model.lm_head = PackedLinear(emb.weight, batch_hint=batch_hint(emb.weight.dtype))
        count += 1
    return count
