"""Paged attention through the native CPU kernel (``_paged_attention.c``).

One kernel call per layer and step stores this step's K/V at their slots and runs every
request's attention reading K/V in place through its block table: no gather of the context, no
padding mask, GQA without repeating K/V, fp32 math for fp32 and bf16 caches. The call's inputs
that do not change between layers (one row per request, the block tables concatenated) are
built once per step and kept on the :class:`AttentionMetadata`.

The kernel is optional at install (``setup.py``); :data:`AVAILABLE` says whether it was built.
Whatever it does not cover (CUDA tensors, fp16, views whose head dim is not contiguous, more
than 32 query heads per KV head) goes to the torch backend, which is also the tests' oracle.
Its fast paths (:data:`FAST`) are AVX-512 (with AVX512_BF16: bf16 q.k by ``vdpbf16ps`` on K rows
as stored) and AVX2 code for head dims 64, 96 and 128; elsewhere
it is correct but plain loops, slower than the torch backend, so ``auto`` uses it only where
fast, and on AVX2 for decode-only steps (its AVX2 prefill measured ~1.1x the torch backend's
time, its AVX2 decode ~0.5x; benchmarks/results/decode_paged_vs_dense.md).
"""

from __future__ import annotations

import torch

from kvserve.engine.attention.metadata import AttentionMetadata
from kvserve.engine.attention.torch_backend import TorchAttentionBackend

try:
    from kvserve.engine.attention import _paged_attention as _native
except ImportError:  # built without a C compiler (setup.py marks the extension optional)
    _native = None

# Whether the native kernel was built (else only the torch backend exists).
AVAILABLE = _native is not None
# The paths it runs on this CPU (avx512bf16 | avx512 | avx2 | baseline) and whether they are fast
# ones (register-blocked vector code for head dims FAST_HEAD_DIMS).
ISA = _native.build_info()["isa"] if _native is not None else None
FAST = ISA in ("avx512bf16", "avx512", "avx2")
PREFILL_FAST_ISAS = ("avx512bf16", "avx512")  # where prefill tiles are fast too (AVX2: decode)
FAST_HEAD_DIMS = (64, 96, 128)

_ELEM_BYTES = {torch.float32: 4, torch.bfloat16: 2}
MAX_GROUP = 32  # query heads per KV head the kernel tiles (TILE_ROWS in the C source)
MAX_HEAD_DIM = 512


def build_info() -> dict[str, object]:
    """``{'openmp', 'isa', 'vector_paths'}`` of the built kernel, ``{}`` when not built."""
    return _native.build_info() if _native is not None else {}


def _step_plan(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reqs [N, 4], tables)`` int64: per request (query start, query len, seq_len, offset
    of its block table in ``tables``), built once per step."""
    plan = meta.backend_state.get("native")
    if plan is None:
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        offset = 0
        nd = meta.num_decodes
        if nd:
            mb = meta.decode_max_blocks
            for i in range(nd):
                rows += (i, 1, meta.seq_lens[i], i * mb)
            parts.append(meta.decode_block_ids)
            offset = nd * mb
        for p in meta.prefills:
            rows += (p.query_start, p.query_len, p.seq_len, offset)
            parts.append(p.block_table)
            offset += p.block_table.numel()
        reqs = torch.tensor(rows, dtype=torch.long).view(-1, 4)
        tables = parts[0] if len(parts) == 1 else torch.cat(parts)
        plan = meta.backend_state["native"] = (reqs, tables.to(torch.long).contiguous())
    return plan


class NativeAttentionBackend:
    """Same interface as :class:`TorchAttentionBackend`; one instance serves every layer."""

    name = "native"
    write_kv = staticmethod(TorchAttentionBackend.write_kv)

    def __init__(self, fast_only: bool = False) -> None:
        """``fast_only``: run the kernel only where its fast paths do (:data:`FAST`, head dims
        :data:`FAST_HEAD_DIMS`, on AVX2 decode-only steps), the torch backend elsewhere (what
        ``auto`` selects)."""
        self.fast_only = fast_only
        if _native is None:
            raise RuntimeError(
                "the native paged-attention kernel was not built (no C compiler at install?); "
                "use the torch backend"
            )
        self.fallback = TorchAttentionBackend()

    def release_workspace(self) -> None:
        self.fallback.release_workspace()

    def supports(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor
    ) -> bool:
        """Whether the kernel takes these tensors (else :meth:`forward` uses the fallback)."""
        dtype = kv_layer.dtype
        h_q, h_kv, d = q.shape[1], kv_layer.shape[3], kv_layer.shape[4]
        if self.fast_only and not (FAST and d in FAST_HEAD_DIMS):
            return False
        return (
            kv_layer.device.type == "cpu"
            and dtype in _ELEM_BYTES
            and q.dtype == k.dtype == v.dtype == dtype
            and h_q % h_kv == 0
            and h_q // h_kv <= MAX_GROUP
            and d <= MAX_HEAD_DIM
            and q.stride(2) == k.stride(2) == v.stride(2) == kv_layer.stride(4) == 1
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q ``[T, H_q, D]``, k/v ``[T, H_kv, D]`` (this step's tokens), ``kv_layer``: one
        layer of the paged cache ``[num_blocks, 2, block_size, H_kv, D]``. Stores k/v at
        ``meta.slot_mapping`` and returns the attention output ``[T, H_q, D]``."""
        if not self.supports(q, k, v, kv_layer) or (
            self.fast_only and meta.num_prefills and ISA not in PREFILL_FAST_ISAS
        ):
            return self.fallback.forward(q, k, v, kv_layer, meta, scale)
        slots = meta.slot_mapping
        if not q.shape[0] == k.shape[0] == v.shape[0] == slots.numel() == meta.num_tokens:
            raise ValueError("q, k, v and the metadata disagree on the number of tokens")
        reqs, tables = _step_plan(meta)
        out = torch.empty(q.shape, dtype=q.dtype)
        num_blocks, _, block_size, h_kv, d = kv_layer.shape
        _native.attend(
            q.data_ptr(), q.stride(0), q.stride(1),
            k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1),
            out.data_ptr(), out.stride(0), out.stride(1),
            kv_layer.data_ptr(), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
            kv_layer.stride(3), num_blocks,
            slots.data_ptr(), slots.numel(),
            reqs.data_ptr(), reqs.shape[0], tables.data_ptr(),
            q.shape[1], h_kv, d, block_size, _ELEM_BYTES[q.dtype],
            torch.get_num_threads(), float(scale),
        )  # fmt: skip
        return out
