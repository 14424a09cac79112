"""Per-step attention metadata: where this step's tokens go in the paged KV cache and what
context each request's queries attend to.

Built once per step by the model runner and shared by every layer, so per-layer work is only
tensor ops: slot indices, flat decode block lists and masks are computed here once. Requests
are ordered decodes first (one query token each), then prefills (chunks of one or more prompt
tokens). Sliding-window layers read :meth:`AttentionMetadata.window_view`: the same step with
block lists cut to the window and masks hiding keys older than it (built once per step and
window).

Models with several KV cache groups (:mod:`kvserve.engine.kv_cache_spec`) get one metadata
per group (:meth:`AttentionMetadata.for_group`): the same queries and masks over that group's
block tables (slot mapping, decode block lists, prefill tables); a sliding-window group's
tables hold the null block where the window no longer reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillInfo:
    """One prefill request: queries are positions ``[num_computed, seq_len)``."""

    query_start: int  # offset of its first query token in the flat batch
    query_len: int
    num_computed: int  # tokens already in the cache (context before this chunk)
    block_table: torch.Tensor  # block ids (long, on device) of positions [kv_start, seq_len)
    # [query_len, seq_len - kv_start] bool (True = attend); None: plain causal, no context.
    causal_mask: torch.Tensor | None = None
    # First key position attended (> 0 only in a sliding-window view); the block table then
    # starts at block kv_start // block_size.
    kv_start: int = 0

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
    # Decodes (batched): block tables padded with the null block 0, flattened row-major to
    # [num_decodes * decode_max_blocks] (one index_select gathers them all).
    decode_block_ids: torch.Tensor | None = None
    decode_max_blocks: int = 0
    # Keys each decode attends to after the gather: all decodes see ``decode_kv_len`` slots;
    # when their lengths differ, ``decode_mask`` [num_decodes, 1, 1, decode_kv_len] (bool,
    # True = attend) hides the padding, else it is None (no mask at all).
    decode_kv_len: int = 0
    decode_mask: torch.Tensor | None = None
    # Gathered slots before this one are never attended (sliding-window views): decodes read
    # slots [decode_kv_offset, decode_kv_len) and decode_mask spans just those.
    decode_kv_offset: int = 0
    # The sliding window this metadata applies (None: full attention).
    window: int | None = None
    prefills: list[PrefillInfo] = field(default_factory=list)
    # Per-step caches shared by every layer: ``write_rows`` per KV-view geometry, additive
    # masks per (mask id, dtype).
    _rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)
    _masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, repr=False)
    # Per-step inputs a backend derives from this metadata once and reuses in every layer
    # (the native kernel's request rows and concatenated block tables), by backend name.
    backend_state: dict[str, object] = field(default_factory=dict, repr=False)
    _windows: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False)
    # Several KV cache groups: every group's metadata (this one is group 0's); else empty.
    groups: list[AttentionMetadata] = field(default_factory=list, repr=False)
    # Window views by window, shared by every group's metadata of the step: another group's
    # view of the same window reuses its block indices and masks (only tables differ).
    _shared_windows: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False)
    _window_idx: torch.Tensor | None = field(default=None, repr=False)  # decode gather index

    def for_group(self, group_idx: int) -> AttentionMetadata:
        """The metadata of KV cache group ``group_idx`` (``self`` for group 0)."""
        return self.groups[group_idx] if group_idx else self

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def decode_block_tables(self) -> torch.Tensor | None:
        """``[num_decodes, max_blocks]`` view of :attr:`decode_block_ids`."""
        if self.decode_block_ids is None:
            return None
        return self.decode_block_ids.view(self.num_decodes, self.decode_max_blocks)

    def write_rows(self, block_stride: int, kv_stride: int) -> torch.Tensor:
        """Row indices ``[2T]`` (K rows, then V rows) of this step's tokens in a view of one
        layer's cache as rows of ``H_kv * D`` elements, where block ``b``'s K (V) slot ``o``
        is row ``b * block_stride + o`` (``+ kv_stride``)."""
        key = (block_stride, kv_stride)
        rows = self._rows.get(key)
        if rows is None:
            blocks = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
            k_rows = blocks * block_stride + (self.slot_mapping - blocks * self.block_size)
            rows = self._rows[key] = torch.cat([k_rows, k_rows + kv_stride])
        return rows

    def additive_mask(self, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` (bool, True = attend; one of this metadata's masks) as 0 / -inf in
        ``dtype``, converted once per step (SDPA's fused CPU kernel wants the query's dtype and
        would convert a bool mask on every layer)."""
        if mask is None:
            return None
        key = (id(mask), dtype)
        out = self._masks.get(key)
        if out is None:
            out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            out = self._masks[key] = out.masked_fill_(~mask, float("-inf"))
        return out

    def window_view(self, window: int) -> AttentionMetadata:
        """This step for a layer with a sliding window of ``window`` tokens (a query at
        position p attends keys (p - window, p]): decode block lists start at each request's
        first block in the window, prefills gather from the block of their first query's
        window and mask keys older than each query's window. Built once per step and window;
        ``self`` when no request is longer than the window."""
        view = self._windows.get(window)
        if view is None:
            view = self if max(self.seq_lens) <= window else self._windowed(window)
            self._windows[window] = view
        return view

    def _windowed(self, window: int) -> AttentionMetadata:
        bs = self.block_size
        view = dataclasses.replace(
            self, prefills=[], backend_state={}, _windows={}, window=window, groups=[]
        )
        nd = self.num_decodes
        tmpl = self._shared_windows.get(window)
        if tmpl is not None:  # another group's view: the same positions in our tables
            if nd:
                idx = tmpl._window_idx
                view.decode_block_ids = self.decode_block_tables.gather(1, idx).reshape(-1)
                view.decode_max_blocks, view._window_idx = tmpl.decode_max_blocks, idx
                view.decode_kv_offset, view.decode_kv_len = (
                    tmpl.decode_kv_offset,
                    tmpl.decode_kv_len,
                )
                view.decode_mask = tmpl.decode_mask
            for p, tp in zip(self.prefills, tmpl.prefills, strict=True):
                if p.seq_len <= window:
                    view.prefills.append(p)
                    continue
                table = p.block_table if p.num_computed == 0 else p.block_table[tp.kv_start // bs :]
                view.prefills.append(dataclasses.replace(tp, block_table=table))
            return view
        self._shared_windows[window] = view
        if nd:
            dev = self.decode_block_ids.device
            lens = self.seq_lens[:nd]
            starts = [max(0, n - window) for n in lens]
            first = [s // bs for s in starts]
            nblocks = max(-(-n // bs) - f for n, f in zip(lens, first, strict=True))
            idx = torch.tensor(first)[:, None] + torch.arange(nblocks)[None, :]
            idx = view._window_idx = idx.clamp_(max=self.decode_max_blocks - 1).to(dev)
            view.decode_block_ids = self.decode_block_tables.gather(1, idx).reshape(-1)
            view.decode_max_blocks = nblocks
            offs = [s - f * bs for s, f in zip(starts, first, strict=True)]
            ends = [n - f * bs for n, f in zip(lens, first, strict=True)]
            view.decode_kv_offset, view.decode_kv_len = min(offs), max(ends)
            view.decode_mask = None
            if len(set(offs)) > 1 or len(set(ends)) > 1:
                span = torch.arange(min(offs), max(ends))[None, :]
                mask = (span >= torch.tensor(offs)[:, None]) & (span < torch.tensor(ends)[:, None])
                view.decode_mask = mask[:, None, None, :].to(dev)
        for p in self.prefills:
            if p.seq_len <= window:
                view.prefills.append(p)
                continue
            c, q = p.num_computed, p.query_len
            start = max(0, c - window + 1)  # oldest key of the first query's window
            dev = p.block_table.device
            qpos = torch.arange(c, c + q, device=dev)[:, None]
            kpos = torch.arange(start, c + q, device=dev)[None, :]
            mask = (kpos <= qpos) & (kpos > qpos - window)
            table = p.block_table if c == 0 else p.block_table[start // bs :]
            view.prefills.append(
                dataclasses.replace(p, block_table=table, causal_mask=mask, kv_start=start)
            )
        return view

    @classmethod
    def build(
        cls,
        *,
        block_size: int,
        query_lens: list[int],
        num_computed: list[int],
        block_tables: list[list[int]],
        device: torch.device | str = "cpu",
        group_block_tables: list[list[list[int]]] | None = None,
    ) -> AttentionMetadata:
        """Build metadata for requests already ordered decodes first.

        ``block_tables[i]`` must cover positions ``[0, num_computed[i] + query_lens[i])``.
        ``group_block_tables[g][i]``: request i's table in KV cache group g (several groups;
        ``block_tables`` is then group 0's), null block ids allowed where no query reads.
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
            if q == 1:
                slots.append(table[c // block_size] * block_size + c % block_size)
                continue
            # Whole-block runs: slots of positions [c, c + q) block by block.
            pos = c
            while pos < seq_len:
                off = pos % block_size
                take = min(block_size - off, seq_len - pos)
                base = table[pos // block_size] * block_size
                slots.extend(range(base + off, base + off + take))
                pos += take
        meta = cls(
            block_size=block_size,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=starts,
            seq_lens=seq_lens,
            num_decodes=num_decodes,
            num_prefills=n - num_decodes,
        )
        if num_decodes:
            dec_lens = seq_lens[:num_decodes]
            max_len = max(dec_lens)
            max_blocks = -(-max_len // block_size)
            flat: list[int] = []
            for i in range(num_decodes):
                table = block_tables[i]
                if len(table) >= max_blocks:
                    flat.extend(table[:max_blocks])
                else:
                    flat.extend(table)
                    flat.extend([0] * (max_blocks - len(table)))
            meta.decode_block_ids = torch.tensor(flat, dtype=torch.long, device=device)
            meta.decode_max_blocks = max_blocks
            meta.decode_kv_len = max_len
            if min(dec_lens) != max_len:
                lens = torch.tensor(dec_lens, dtype=torch.long, device=device)
                span = torch.arange(max_len, device=device)
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
        if group_block_tables is not None and len(group_block_tables) > 1:
            meta.groups = [meta] + [
                meta._with_block_tables(tables, device) for tables in group_block_tables[1:]
            ]
        return meta

    def _with_block_tables(
        self, block_tables: list[list[int]], device: torch.device | str
    ) -> AttentionMetadata:
        """This step over another KV cache group's block tables (same queries and masks)."""
        bs = self.block_size
        nd = self.num_decodes
        starts = self.query_start_loc
        slots: list[int] = []
        for i, table in enumerate(block_tables):
            seq_len = self.seq_lens[i]
            if len(table) * bs < seq_len:
                raise ValueError(
                    f"block table of {len(table)} blocks too short for {seq_len} tokens"
                )
            pos = seq_len - (starts[i + 1] - starts[i])
            if i < nd:
                slots.append(table[pos // bs] * bs + pos % bs)
                continue
            while pos < seq_len:
                off = pos % bs
                take = min(bs - off, seq_len - pos)
                base = table[pos // bs] * bs
                slots.extend(range(base + off, base + off + take))
                pos += take
        meta = dataclasses.replace(
            self,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            prefills=[],
            _rows={},
            backend_state={},
            _windows={},
            groups=[],
        )
        if nd:
            mb = self.decode_max_blocks
            flat: list[int] = []
            for table in block_tables[:nd]:
                flat.extend(table[:mb])
                if len(table) < mb:
                    flat.extend([0] * (mb - len(table)))
            meta.decode_block_ids = torch.tensor(flat, dtype=torch.long, device=device)
        for p, table in zip(self.prefills, block_tables[nd:], strict=True):
            t = torch.tensor(table[: -(-p.seq_len // bs)], dtype=torch.long, device=device)
            meta.prefills.append(dataclasses.replace(p, block_table=t))
        return meta
