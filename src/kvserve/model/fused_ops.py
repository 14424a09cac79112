"""One-pass RMSNorm (after an optional residual add), RoPE in place and SiLU-and-mul for the
Llama-family layers.

On CPU, for fp32 and bf16 rows with a contiguous last dim, the C extension ``_fused_ops`` (built
by ``setup.py`` where there is a compiler) does each in one pass over memory, with the
roundings of the torch ops it replaces (RoPE bit for bit; RMSNorm's sum of squares and SiLU's
exp may differ from torch's in the last fp32 bit). Anywhere else (CUDA, fp16, no compiler,
other layouts, autograd) the same torch ops run: they are also the tests' oracle. This module
owns no state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from kvserve.model import _fused_ops as _native
except ImportError:  # built without a C compiler (setup.py marks the extension optional)
    _native = None

# Whether the C extension was built.
AVAILABLE = _native is not None
_ELEM_BYTES = {torch.float32: 4, torch.bfloat16: 2}


def _native_rows(*tensors: torch.Tensor) -> bool:
    """Whether the C path takes these tensors: CPU, one dtype it knows, unit stride in the last
    dim, no autograd."""
    if _native is None:
        return False
    dtype = tensors[0].dtype
    return dtype in _ELEM_BYTES and all(
        t.device.type == "cpu"
        and t.dtype == dtype
        and t.stride(-1) == 1
        and not (t.requires_grad and torch.is_grad_enabled())
        for t in tensors
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight * rmsnorm(x)`` as HF computes it (fp32 norm, cast to ``x``'s dtype, then the
    weight multiply). With ``residual``, ``x += residual`` first, in place (``x`` becomes the
    residual stream), and the norm is of the sum."""
    if (
        x.dim() == 2
        and weight.dim() == 1
        and weight.shape[0] == x.shape[1]
        and weight.is_contiguous()
        and (residual is None or (residual.shape == x.shape and _native_rows(residual)))
        and _native_rows(x, weight)
    ):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _native.rms_norm(
            x.data_ptr(), x.stride(0),
            0 if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            out.data_ptr(), out.stride(0), weight.data_ptr(), x.shape[0], x.shape[1],
            _ELEM_BYTES[x.dtype], torch.get_num_threads(), float(eps),
        )  # fmt: skip
        return out
    if residual is not None:
        x = x.add_(residual)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[T, H, D]`` in place (``x`` returned): ``[x1 c - x2 s,
    x2 c + x1 s]`` over its halves, each product rounded to ``x``'s dtype as HF's
    ``x * cos + rotate_half(x) * sin`` rounds; ``cos``/``sin`` ``[T, 1, D/2]`` in that dtype."""
    t, h, d = x.shape
    if (
        cos.shape[0] == sin.shape[0] == t
        and cos.shape[-1] == sin.shape[-1] == d // 2
        and cos.is_contiguous()
        and sin.is_contiguous()
        and _native_rows(x, cos, sin)
    ):
        _native.rope(
            x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), t, h, d,
            _ELEM_BYTES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        return x
    x1, x2 = x.chunk(2, dim=-1)
    o1 = x1 * cos
    o1.sub_(x2 * sin)
    o2 = x2 * cos
    o2.add_(x1 * sin)
    x1.copy_(o1)
    x2.copy_(o2)
    return x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2 I]`` (gate, then up), rounded as
    ``F.silu(gate).mul_(up)`` rounds."""
    rows, width = gate_up.shape
    cols = width // 2
    if _native_rows(gate_up):
        out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
        _native.silu_and_mul(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), rows, cols,
            _ELEM_BYTES[gate_up.dtype], torch.get_num_threads(),
        )  # fmt: skip
        return out
    gate, up = gate_up.split(cols, dim=-1)
    return F.silu(gate).mul_(up)
