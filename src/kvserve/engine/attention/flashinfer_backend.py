"""Paged attention on CUDA through FlashInfer's paged-KV kernels, when ``flashinfer`` imports.

FlashInfer reads K/V in place through per-request page lists (CSR: ``indptr`` / ``indices`` /
``last_page_len``), any page size, GQA natively. Per step, :meth:`plan` turns the host-side
:class:`AttentionMetadata` (decodes first, then prefills) into those lists and plans one decode
wrapper (one query per request) and one prefill wrapper (causal, queries aligned to the end of
each request's context, so chunked prefill over a cached prefix is exact); every layer then
runs the planned kernels. The step's K/V are stored with the torch backend's ``write_kv`` (one
``index_copy_`` per layer). The per-layer cache view ``kv_cache[:, layer]`` is strided across
blocks (the block holds all layers); it is passed as a ``(K, V)`` pair of strided views.

Not yet run on a GPU: the first forward compares it with the torch backend on that step's
inputs, and on any error or mismatch logs why and serves everything with the torch backend.
"""

from __future__ import annotations

import logging

import torch

from kvserve.engine.attention.metadata import AttentionMetadata
from kvserve.engine.attention.torch_backend import TorchAttentionBackend

try:
    import flashinfer
except ImportError:  # not installed (CPU machines, or a CUDA box without it)
    flashinfer = None

AVAILABLE = flashinfer is not None
WORKSPACE_BYTES = 128 << 20  # FlashInfer's scratch for split-KV partial results
logger = logging.getLogger(__name__)


class FlashInferAttentionBackend:
    """One instance serves every layer; planned once per step by the model runner."""

    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        if flashinfer is None:
            raise RuntimeError("flashinfer is not installed")
        self.device = device
        self.fallback = TorchAttentionBackend()
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._shape: tuple[int, int, int, torch.dtype] | None = None  # heads, kv heads, dim
        self._scale: float | None = None
        self._checked = False  # first forward compared with the torch backend
        self.disabled_reason: str | None = None

    def configure(
        self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, scale: float
    ) -> None:
        """The model's attention shape, needed to plan before the first layer runs."""
        self._shape = (num_heads, num_kv_heads, head_dim, dtype)
        self._scale = scale

    @staticmethod
    def _csr(tables: list[list[int]], seq_lens: list[int], block_size: int):
        indptr, indices, last = [0], [], []
        for table, n in zip(tables, seq_lens, strict=True):
            pages = -(-n // block_size)
            indices.extend(table[:pages])
            indptr.append(len(indices))
            last.append(n - (pages - 1) * block_size)
        as_i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        return as_i32(indptr), as_i32(indices), as_i32(last)

    def plan(self, meta: AttentionMetadata) -> None:
        """Plan this step's kernels from ``meta`` while its tensors are still on the host
        (FlashInfer copies the page lists over without a sync)."""
        if self.disabled_reason is not None or self._shape is None:
            return
        heads, kv_heads, dim, dtype = self._shape
        bs, nd = meta.block_size, meta.num_decodes
        try:
            if nd:
                mb = meta.decode_max_blocks
                ids = meta.decode_block_ids.tolist()  # host tensor: no sync
                tables = [ids[i * mb : (i + 1) * mb] for i in range(nd)]
                indptr, indices, last = self._csr(tables, meta.seq_lens[:nd], bs)
                self._decode.plan(
                    indptr, indices.to(self.device, non_blocking=True), last,
                    heads, kv_heads, dim, bs,
                    pos_encoding_mode="NONE", sm_scale=self._scale,
                    q_data_type=dtype, kv_data_type=dtype,
                )  # fmt: skip
            if meta.prefills:
                tables = [p.block_table.tolist() for p in meta.prefills]
                lens = [p.seq_len for p in meta.prefills]
                indptr, indices, last = self._csr(tables, lens, bs)
                qo = [0]
                for p in meta.prefills:
                    qo.append(qo[-1] + p.query_len)
                self._prefill.plan(
                    torch.tensor(qo, dtype=torch.int32), indptr,
                    indices.to(self.device, non_blocking=True), last,
                    heads, kv_heads, dim, bs,
                    causal=True, sm_scale=self._scale,
                    q_data_type=dtype, kv_data_type=dtype,
                )  # fmt: skip
        except Exception as e:  # an unsupported shape (head dim, dtype) or API drift
            self._disable(f"plan failed: {e!r}")

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        logger.warning("FlashInfer attention disabled, using the torch backend: %s", reason)

    def _run(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata):
        cache = (kv_layer[:, 0], kv_layer[:, 1])  # [num_blocks, block_size, H_kv, D] views
        nd = meta.num_decodes
        parts = []
        if nd:
            parts.append(self._decode.run(q[:nd], cache))
        if meta.prefills:
            parts.append(self._prefill.run(q[nd:], cache))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Same contract as :meth:`TorchAttentionBackend.forward`."""
        if self.disabled_reason is not None or self._shape is None:
            return self.fallback.forward(q, k, v, kv_layer, meta, scale)
        TorchAttentionBackend.write_kv(k, v, kv_layer, meta)
        if self._checked:
            return self._run(q, kv_layer, meta)
        self._checked = True
        try:
            out = self._run(q, kv_layer, meta)
            ref = self.fallback.forward(q, k, v, kv_layer, meta, scale)
            tol = 1e-3 if q.dtype == torch.float32 else 2e-2
            if not torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol):
                err = (out.float() - ref.float()).abs().max().item()
                raise ValueError(f"differs from the torch backend by {err:.3g}")
            return out
        except Exception as e:
            self._disable(f"first step: {e!r}")
            return self.fallback.forward(q, k, v, kv_layer, meta, scale)
