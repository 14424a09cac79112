"""Per-step attention metadata: where this step's tokens go in the paged KV cache and what
context each request's queries attend to.

Built once per step by the model runner and shared by every layer. Requests are ordered
decodes first (one query token each), then prefills (chunks of one or more prompt tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillInfo:
    """One prefill request: queries are positions ``[num_computed, seq_len)``."""

    query_start: int  # offset of its first query token in the flat batch
    query_len: int
    num_computed: int  # tokens already in the cache (context before this chunk)
    block_table: torch.Tensor  # [ceil(seq_len / block_size)] block ids (long, on device)
    causal_mask: torch.Tensor | None = None  # [query_len, seq_len] bool, None if no context

    @property
    def seq_len(self) -> int:
        return self.num_computed + self.query_len


@dataclass
class AttentionMetadata:
    """Everything the attention backend needs for one forward pass."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    query_start_loc: list[int]  # [N + 1] offsets of each request's queries in the flat batch
    seq_lens: list[int]  # [N] context length after this step (cached + new)
    num_decodes: int  # the first num_decodes requests have exactly one query token
    num_prefills: int
    # Decodes (batched): block tables padded with the null block 0, and a padding mask.
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] long
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]
    prefills: list[PrefillInfo] = field(default_factory=list)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @classmethod
    def build(
        cls,
        *,
        block_size: int,
        query_lens: list[int],
        num_computed: list[int],
        block_tables: list[list[int]],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata for requests already ordered decodes first.

        ``block_tables[i]`` must cover positions ``[0, num_computed[i] + query_lens[i])``.
        """
        n = len(query_lens)
        num_decodes = 0
        while num_decodes < n and query_lens[num_decodes] == 1:
            num_decodes += 1
        if any(q == 1 for q in query_lens[num_decodes:]):
            raise ValueError("requests must be ordered decodes (one query token) first")
        starts = [0]
        slots: list[int] = []
        seq_lens = []
        for i in range(n):
            c, q, table = num_computed[i], query_lens[i], block_tables[i]
            seq_len = c + q
            if q <= 0:
                raise ValueError("every scheduled request needs at least one query token")
            if len(table) * block_size < seq_len:
                raise ValueError(
                    f"block table of {len(table)} blocks too short for {seq_len} tokens"
                )
            starts.append(starts[-1] + q)
            seq_lens.append(seq_len)
            for pos in range(c, seq_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        meta = cls(
            block_size=block_size,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=starts,
            seq_lens=seq_lens,
            num_decodes=num_decodes,
            num_prefills=n - num_decodes,
        )
        if num_decodes:
            max_blocks = max(-(-s // block_size) for s in seq_lens[:num_decodes])
            tables = [
                block_tables[i][:max_blocks] + [0] * (max_blocks - len(block_tables[i]))
                for i in range(num_decodes)
            ]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=device)
            lens = torch.tensor(seq_lens[:num_decodes], dtype=torch.long, device=device)
            span = torch.arange(max_blocks * block_size, device=device)
            meta.decode_mask = (span[None, :] < lens[:, None])[:, None, None, :]
        for i in range(num_decodes, n):
            c, q = num_computed[i], query_lens[i]
            nblocks = -(-(c + q) // block_size)
            info = PrefillInfo(
                query_start=starts[i],
                query_len=q,
                num_computed=c,
                block_table=torch.tensor(
                    block_tables[i][:nblocks], dtype=torch.long, device=device
                ),
            )
            if c:
                # Query at position c + j sees keys [0, c + j].
                qpos = torch.arange(c, c + q, device=device)
                info.causal_mask = torch.arange(c + q, device=device)[None, :] <= qpos[:, None]
            meta.prefills.append(info)
        return meta
