"""Paged attention with plain torch ops (CPU, and CUDA tensors alike).

Per layer and step:
- write: this step's K/V go into the cache with one ``index_copy_`` into a row view of the
  layer (one row = one token's ``[H_kv, D]``), at row indices computed once per step;
- decodes (one query each) are batched: every request's blocks are gathered with
  ``index_select`` on the block dimension (one contiguous ``block_size * H_kv * D`` chunk per
  block, memcpy speed) into a reused workspace, then one SDPA call; the grouped query heads of
  one KV head ride in SDPA's query-length dimension, so GQA needs no K/V repetition, and the
  padding mask exists only when the decodes' lengths differ;
- prefills run one SDPA call each: new queries at positions ``[c, c + n)`` attend causally to
  context ``[0, c + n)`` (gathered from the cache when ``c > 0``, else taken from this step's
  K/V directly); sliding-window layers pass :meth:`AttentionMetadata.window_view`, whose
  block lists start in the window and whose masks hide older keys (contexts are sliced to the
  window, a mask only where queries' windows differ). Inputs are 4-D with ``enable_gqa``:
  that is what keeps CPU SDPA on its fused flash kernel (3-D inputs take the math path,
  several times slower).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.engine.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    """One instance serves every layer of a model; it owns only a scratch buffer for the
    gathered K/V (reused across layers and steps, so no per-layer allocation)."""

    name = "torch"

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None

    def _scratch(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        ws = self._workspace
        if ws is None or ws.numel() < numel or ws.dtype != like.dtype or ws.device != like.device:
            ws = self._workspace = torch.empty(numel, dtype=like.dtype, device=like.device)
        return ws[:numel]

    def release_workspace(self) -> None:
        self._workspace = None

    @staticmethod
    def write_kv(
        k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Store ``k``/``v`` ``[T, H_kv, D]`` of this step into ``kv_layer``
        ``[num_blocks, 2, block_size, H_kv, D]`` at ``meta.slot_mapping``."""
        num_blocks, _, block_size, h_kv, d = kv_layer.shape
        row = h_kv * d
        s_blk, s_kv, s_slot = kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2)
        if s_slot != row or s_blk % row or s_kv % row or not kv_layer[0, 0, 0].is_contiguous():
            # Unusual view: element-wise indexed store.
            slots = meta.slot_mapping
            blocks = torch.div(slots, meta.block_size, rounding_mode="floor")
            offsets = slots - blocks * meta.block_size
            kv_layer[blocks, 0, offsets] = k
            kv_layer[blocks, 1, offsets] = v
            return
        rows = meta.write_rows(s_blk // row, s_kv // row)
        num_rows = (num_blocks - 1) * (s_blk // row) + s_kv // row + block_size
        view = torch.as_strided(kv_layer, (num_rows, h_kv, d), (row, d, 1))
        t = k.shape[0]
        view.index_copy_(0, rows[:t], k)
        view.index_copy_(0, rows[t:], v)

    def gather(
        self, kv_layer: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block_ids`` as ``[len(block_ids) * block_size, H_kv, D]`` each (views
        of the workspace, valid until the next gather)."""
        _, _, block_size, h_kv, d = kv_layer.shape
        n = block_ids.numel()
        numel = n * block_size * h_kv * d
        ws = self._scratch(2 * numel, kv_layer)
        kc = ws[:numel].view(n, block_size, h_kv, d)
        vc = ws[numel:].view(n, block_size, h_kv, d)
        torch.index_select(kv_layer[:, 0], 0, block_ids, out=kc)
        torch.index_select(kv_layer[:, 1], 0, block_ids, out=vc)
        return kc.view(n * block_size, h_kv, d), vc.view(n * block_size, h_kv, d)

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
        layer of the paged cache ``[num_blocks, 2, block_size, H_kv, D]``. Returns
        ``[T, H_q, D]``."""
        self.write_kv(k, v, kv_layer, meta)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        nd = meta.num_decodes
        if nd == num_tokens:  # decode-only step: no output scatter
            return self._decode(q, kv_layer, meta, scale, group)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_layer, meta, scale, group)
        for p in meta.prefills:
            s, n = p.query_start, p.query_len
            qp = q[s : s + n]
            if p.num_computed == 0:
                kp, vp = k[s : s + n], v[s : s + n]
            else:
                kp, vp = self.gather(kv_layer, p.block_table)
                lo = p.kv_start % meta.block_size  # > 0: sliding window, table from its block
                hi = lo + p.seq_len - p.kv_start
                kp, vp = kp[lo:hi], vp[lo:hi]
            # 4-D inputs: on CPU, 3-D ones (and GQA) fall back to the unfused math kernel.
            mask = meta.additive_mask(p.causal_mask, q.dtype)
            mask = None if mask is None else mask[None, None]
            o = F.scaled_dot_product_attention(
                qp.transpose(0, 1)[None],
                kp.transpose(0, 1)[None],
                vp.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=group > 1,
            )
            out[s : s + n] = o[0].transpose(0, 1)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        group: int,
    ) -> torch.Tensor:
        b, num_heads, head_dim = q.shape
        num_kv_heads = num_heads // group
        kc, vc = self.gather(kv_layer, meta.decode_block_ids)
        s = meta.decode_kv_len
        # [B * MB * BS, H_kv, D] -> [B, H_kv, S, D] (strided view, no copy).
        lo = meta.decode_kv_offset  # > 0: sliding window past its first block's start
        kc = kc.view(b, -1, num_kv_heads, head_dim)[:, lo:s].transpose(1, 2)
        vc = vc.view(b, -1, num_kv_heads, head_dim)[:, lo:s].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.view(b, num_kv_heads, group, head_dim),
            kc,
            vc,
            attn_mask=meta.additive_mask(meta.decode_mask, q.dtype),
            scale=scale,
        )
        return o.reshape(b, num_heads, head_dim)
