"""Block tables of one KV cache group: prefix hits, allocation, freeing, by attention type.

Owns ``request_id -> blocks`` of one group and how many of them are cached. A table covers
positions from 0: entries a sliding window no longer reads are the null block (freed back to
the pool, still hittable under their hash until evicted). The coordinator
(:class:`~kvserve.engine.kv_cache_manager.KVCacheManager`) decides the hit length every group
agrees on and allocates for all groups at once; never touches tensors.

- :class:`FullAttentionManager`: every block is kept; the longest hit is the longest run of
  cached blocks from the start.
- :class:`SlidingWindowManager`: blocks wholly before ``num_computed_tokens - window + 1`` (the
  oldest key of the next query) are freed; a hit of L tokens needs only the blocks covering
  ``[L - window + 1, L)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.engine.block_pool import BlockPool, KVCacheBlock
from kvserve.engine.hashing import BlockHash
from kvserve.engine.kv_cache_spec import KVCacheSpec, SlidingWindowSpec, cdiv
from kvserve.engine.request import Request


class SingleTypeKVCacheManager:
    """Block tables of one group (full attention: nothing is ever skipped)."""

    def __init__(self, spec: KVCacheSpec, group_idx: int, pool: BlockPool) -> None:
        self.spec = spec
        self.group_idx = group_idx
        self.pool = pool
        self.block_size = pool.block_size
        self.null_block = pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request already in the prefix cache (or null).
        self.num_cached_block: dict[str, int] = {}

    # -- prefix hits ----------------------------------------------------------------------
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_blocks: int
    ) -> list[KVCacheBlock]:
        """Cached blocks of the longest hit within the first ``max_blocks`` blocks."""
        get = self.pool.cached_by_group[self.group_idx].get
        blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_blocks]:
            holders = get(block_hash)
            if not holders:
                break
            blocks.append(next(iter(holders.values())))
        return blocks

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return 0

    # -- allocation -----------------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no later query reads (none for full attention)."""

    def get_num_blocks_to_allocate(
        self, request_id: str, num_slots: int, computed: list[KVCacheBlock], num_computed: int
    ) -> tuple[int, int]:
        """``(new blocks, free hit blocks to take)`` for a table of ``num_slots`` slots after
        adding the prefix hits ``computed``, with ``num_computed`` tokens computed."""
        held = self.req_to_blocks.get(request_id)
        num_held = (len(held) if held else 0) + len(computed)
        skip = self.num_skipped_blocks(num_computed)
        new = max(cdiv(num_slots, self.block_size) - max(num_held, skip), 0)
        if not computed:
            return new, 0
        hits = sum(1 for i, b in enumerate(computed) if b.ref_cnt == 0 and i >= skip)
        return new, hits

    def save_computed_blocks(
        self, request_id: str, computed: list[KVCacheBlock], num_computed: int
    ) -> None:
        """Start the request's table with its prefix hits (those it still reads)."""
        skip = self.num_skipped_blocks(num_computed)
        if skip:
            null = self.null_block
            computed = [null if i < skip else b for i, b in enumerate(computed)]
        self.pool.touch(computed)
        self.req_to_blocks[request_id] = list(computed)
        self.num_cached_block[request_id] = len(computed)

    def allocate_new_blocks(
        self, request_id: str, num_slots: int, num_computed: int
    ) -> list[KVCacheBlock]:
        """Extend the table to ``num_slots`` slots; positions already skipped get the null
        block. Returns the new (pool) blocks."""
        table = self.req_to_blocks.setdefault(request_id, [])
        want = cdiv(num_slots, self.block_size)
        if want <= len(table):
            return []
        skip = self.num_skipped_blocks(num_computed)
        if skip > len(table):
            table.extend([self.null_block] * (min(skip, want) - len(table)))
        n = want - len(table)
        new = self.pool.get_new_blocks(n) if n > 0 else []
        table.extend(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Make the table's full blocks within the first ``num_tokens`` tokens hittable."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        num_full = min(num_tokens // self.block_size, len(blocks))
        num_cached = self.num_cached_block.get(rid, 0)
        if num_full <= num_cached:
            return
        self.pool.cache_full_blocks(request, blocks, num_cached, num_full, self.group_idx)
        self.num_cached_block[rid] = num_full

    def uncache_from(self, request_id: str, block_index: int) -> None:
        """Blocks from ``block_index`` on hold wrong KV: drop them from the cache (they stay
        in the table and are recomputed)."""
        blocks = self.req_to_blocks.get(request_id, [])
        self.pool.evict_blocks(b.block_id for b in blocks[block_index:] if b.block_hash is not None)
        if self.num_cached_block.get(request_id, 0) > block_index:
            self.num_cached_block[request_id] = block_index

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so its prefix outlives its tail."""
        self.num_cached_block.pop(request_id, None)
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block of a request is kept until it finishes."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window: only the window before the next query is kept."""

    def __init__(self, spec: SlidingWindowSpec, group_idx: int, pool: BlockPool) -> None:
        super().__init__(spec, group_idx, pool)
        self.window = spec.window
        # Blocks are freed only in whole runs of ``hold_blocks`` (an offload chunk): a chunk's
        # blocks stay until it is complete and its store was planned (0: no such hold).
        self.hold_blocks = 0

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return self.spec.num_skipped_blocks(num_computed_tokens, self.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_blocks: int
    ) -> list[KVCacheBlock]:
        """The longest hit of E <= ``max_blocks`` blocks whose window blocks
        ``[skip(E * bs), E)`` are all cached: null blocks before them, those after."""
        get = self.pool.cached_by_group[self.group_idx].get
        bs = self.block_size
        end = min(max_blocks, len(block_hashes))
        while end > 0:
            lo = self.num_skipped_blocks(end * bs)
            found: list[KVCacheBlock] = []
            for i in range(end - 1, lo - 1, -1):
                holders = get(block_hashes[i])
                if not holders:
                    break
                found.append(next(iter(holders.values())))
            else:
                found.reverse()
                return [self.null_block] * lo + found
            end = i  # block i is missing: a hit ends before it
        return []

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        skip = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
        if self.hold_blocks:
            k = self.hold_blocks
            skip = min(skip, num_computed_tokens // (k * self.block_size) * k)
        null = self.null_block
        freed: list[KVCacheBlock] = []
        # Walk back from the last skipped block to the first one already null.
        for i in range(skip - 1, -1, -1):
            block = blocks[i]
            if block is null:
                break
            freed.append(block)
            blocks[i] = null
        if freed:
            freed.reverse()  # oldest first: the LRU evicts them first
            self.pool.free_blocks(freed)


def make_manager(spec: KVCacheSpec, group_idx: int, pool: BlockPool) -> SingleTypeKVCacheManager:
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, group_idx, pool)
    return FullAttentionManager(spec, group_idx, pool)
