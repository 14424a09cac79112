"""Paged attention with plain torch ops (CPU, and CUDA tensors alike).

Per layer and step: write the new tokens' K/V into the paged cache at ``slot_mapping``, then
- decodes (one query each) are batched: gather every request's blocks through its padded
  block table and run one SDPA call with a padding mask; the grouped query heads of one KV
  head ride in SDPA's query-length dimension, so GQA needs no K/V repetition;
- prefills run one SDPA call each: new queries at positions ``[c, c + n)`` attend causally to
  context ``[0, c + n)`` (gathered from the cache when ``c > 0``, else taken from this step's
  K/V directly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.engine.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    """Stateless; one instance serves every layer."""

    name = "torch"

    @staticmethod
    def write_kv(
        k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Store ``k``/``v`` ``[T, H_kv, D]`` of this step into ``kv_layer``
        ``[num_blocks, 2, block_size, H_kv, D]`` at ``meta.slot_mapping``."""
        slots = meta.slot_mapping
        blocks = torch.div(slots, meta.block_size, rounding_mode="floor")
        offsets = slots - blocks * meta.block_size
        kv_layer[blocks, 0, offsets] = k
        kv_layer[blocks, 1, offsets] = v

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
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            tables = meta.decode_block_tables  # [B, MB]
            b, mb = tables.shape
            # [B, MB, BS, H_kv, D] -> [B, H_kv, S, D]
            kc = kv_layer[:, 0][tables].view(b, mb * meta.block_size, num_kv_heads, head_dim)
            vc = kv_layer[:, 1][tables].view(b, mb * meta.block_size, num_kv_heads, head_dim)
            qd = q[:nd].view(b, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(
                qd, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=meta.decode_mask, scale=scale
            )
            out[:nd] = o.reshape(b, num_heads, head_dim)
        for p in meta.prefills:
            s, n = p.query_start, p.query_len
            qp = q[s : s + n]
            if p.num_computed == 0:
                kp, vp = k[s : s + n], v[s : s + n]
            else:
                kp = kv_layer[:, 0][p.block_table].flatten(0, 1)[: p.seq_len]
                vp = kv_layer[:, 1][p.block_table].flatten(0, 1)[: p.seq_len]
            o = F.scaled_dot_product_attention(
                qp.transpose(0, 1),
                kp.transpose(0, 1),
                vp.transpose(0, 1),
                attn_mask=p.causal_mask,
                is_causal=p.causal_mask is None,
                scale=scale,
                enable_gqa=group > 1,
            )
            out[s : s + n] = o.transpose(0, 1)
        return out
