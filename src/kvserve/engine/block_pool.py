"""The primary KV block pool: blocks, their ref counts, the free LRU queue and the prefix cache.

Owns which physical block ids are free, in use or cached ((hash, KV cache group) -> block),
and the KV events that describe changes of what is cached. Knows nothing about requests beyond
reading their token ids and block hashes when caching; per-request block tables live in
:mod:`kvserve.engine.kv_cache_manager`. One pool serves every KV cache group of a hybrid model
(:mod:`kvserve.engine.kv_cache_spec`): each group caches its own blocks under its own map,
and its events say which group (``group_idx``) and what kind of KV it holds.

Invariants (checked by :meth:`BlockPool.check_integrity`):
- block 0 is the null block: never handed out, never in the free queue, never cached;
- a block is in the free queue iff its ref count is 0;
- free + in use == num_blocks - 1; a cached block (hash set) is in its group's map under its hash.

A free block keeps its hash (and stays hittable) until it is popped for reuse: that is when it
is evicted. Freed blocks without a hash go to the head of the free queue (they hold nothing
worth keeping), freed cached blocks to the tail (LRU).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvserve.engine.hashing import BlockHash, block_extra_keys, hash_to_int
from kvserve.engine.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from kvserve.kv.events import MEDIUM_GPU, AllBlocksCleared, AnyKVEvent, BlockRemoved, BlockStored

if TYPE_CHECKING:
    from kvserve.engine.request import Request


class KVCacheBlock:
    """One physical block of the pool, with intrusive links for the free queue."""

    __slots__ = (
        "block_id", "ref_cnt", "block_hash", "group_idx", "prev_free_block", "next_free_block"
    )  # fmt: skip

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_idx = 0  # the KV cache group it is cached for (while block_hash is set)
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


def _block_id(block: KVCacheBlock) -> int:
    return block.block_id


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks; O(1) pop at the head, append, removal from the middle.

    The head is the next block to reuse (least recently freed), the tail the most recent.
    Sentinel head/tail nodes avoid None checks on every operation.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free_block
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free_block

    def _link_before(self, block: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise AssertionError(f"{block} is already in the free queue")
        prev = nxt.prev_free_block
        assert prev is not None
        prev.next_free_block = block
        block.prev_free_block = prev
        block.next_free_block = nxt
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, have {self.num_free_blocks}")
        out: list[KVCacheBlock] = []
        node = self._head.next_free_block
        for _ in range(n):
            assert node is not None and node is not self._tail
            nxt = node.next_free_block
            node.prev_free_block = node.next_free_block = None
            out.append(node)
            node = nxt
        assert node is not None
        self._head.next_free_block = node
        node.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise AssertionError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._link_before(block, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free_block
        assert first is not None
        self._link_before(block, first)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self._link_before(block, self._tail)

    def block_ids(self) -> list[int]:
        """Free block ids from head (next reused) to tail; for tests and debugging."""
        return [b.block_id for b in self]


class BlockPool:
    """All KV blocks of one pool (the engine's primary pool, or a CPU tier reusing it)."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        block_size: int,
        enable_kv_cache_events: bool = True,
        medium: str = MEDIUM_GPU,
        group_specs: Sequence[KVCacheSpec] | None = None,
    ) -> None:
        """``group_specs``: the spec of each KV cache group caching here (default: one
        full-attention group)."""
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (1 is the null block), got {num_blocks}"
            )
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.medium = medium
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.group_specs: tuple[KVCacheSpec, ...] = tuple(group_specs or (FullAttentionSpec(),))
        # Per group: hash -> {block_id: block}; several blocks may hold the same hash
        # (duplicates). ``cached_block_hash_to_block`` is group 0's.
        self.cached_by_group: list[dict[BlockHash, dict[int, KVCacheBlock]]] = [
            {} for _ in self.group_specs
        ]
        self.cached_block_hash_to_block = self.cached_by_group[0]
        self._events: list[AnyKVEvent] = []

    # -- prefix cache ---------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash, group_idx: int = 0) -> KVCacheBlock | None:
        """A block holding ``block_hash`` for group ``group_idx`` (free or in use), or None."""
        blocks = self.cached_by_group[group_idx].get(block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_idx: int = 0,
    ) -> None:
        """Make ``blocks[num_cached_blocks:num_full_blocks]`` hittable under the request's hashes.

        ``blocks`` is the request's block table in group ``group_idx``; the first
        ``num_cached_blocks`` are already cached; null entries (blocks a sliding window
        dropped) are skipped. Emits one ``BlockStored`` per run of consecutive newly cached
        blocks.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        hashes = request.block_hashes
        if num_full_blocks > len(hashes) or num_full_blocks > len(blocks):
            raise AssertionError(
                f"{request.request_id}: caching {num_full_blocks} blocks but it has "
                f"{len(hashes)} hashes and {len(blocks)} blocks"
            )
        cached = self.cached_by_group[group_idx]
        run: list[int] = []  # indices of a consecutive run of newly cached blocks
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                if block.block_hash is not None and (
                    block.block_hash != hashes[i] or block.group_idx != group_idx
                ):
                    raise AssertionError(f"{block} at index {i} already holds another hash")
                self._emit_stored(request, run, group_idx)
                run = []
                continue
            block.block_hash = hashes[i]
            block.group_idx = group_idx
            cached.setdefault(hashes[i], {})[block.block_id] = block
            run.append(i)
        self._emit_stored(request, run, group_idx)

    def _emit_stored(self, request: Request, indices: list[int], group_idx: int) -> None:
        if not indices or not self.enable_kv_cache_events:
            return
        bs = self.block_size
        first, last = indices[0], indices[-1]
        hashes = request.block_hashes
        salted = bool(request.cache_salt) or bool(request.lora_name)
        spec = self.group_specs[group_idx]
        self._events.append(
            BlockStored(
                block_hashes=[hash_to_int(hashes[i]) for i in indices],
                parent_block_hash=hash_to_int(hashes[first - 1]) if first > 0 else None,
                token_ids=list(request.all_token_ids[first * bs : (last + 1) * bs]),
                block_size=bs,
                medium=self.medium,
                lora_name=request.lora_name,
                extra_keys=[
                    block_extra_keys(i, request.cache_salt, request.lora_name) if salted else None
                    for i in indices
                ],
                group_idx=group_idx,
                kv_cache_spec_kind=spec.kind,
                kv_cache_spec_sliding_window=spec.sliding_window,
            )
        )

    def _uncache(self, block: KVCacheBlock) -> BlockHash | None:
        """Drop ``block`` from its group's map; returns its hash if no other block of the
        group still holds it."""
        block_hash = block.block_hash
        if block_hash is None:
            return None
        block.block_hash = None
        cached = self.cached_by_group[block.group_idx]
        holders = cached.get(block_hash)
        if holders is None or holders.pop(block.block_id, None) is None:
            raise AssertionError(f"block {block.block_id} has a hash but is not in the map")
        if holders:
            return None
        del cached[block_hash]
        return block_hash

    def _emit_removed(self, removed: list[tuple[BlockHash, int]]) -> None:
        """One ``BlockRemoved`` per group (in the order the groups first appear)."""
        if not removed or not self.enable_kv_cache_events:
            return
        by_group: dict[int, list[int]] = {}
        for h, g in removed:
            by_group.setdefault(g, []).append(hash_to_int(h))
        for g, hashes in by_group.items():
            self._events.append(BlockRemoved(block_hashes=hashes, medium=self.medium, group_idx=g))

    def _uncache_into(self, block: KVCacheBlock, removed: list[tuple[BlockHash, int]]) -> None:
        g = block.group_idx
        h = self._uncache(block)
        if h is not None:
            removed.append((h, g))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget the cached content of these blocks (e.g. a failed load wrote them)."""
        removed: list[tuple[BlockHash, int]] = []
        for block_id in block_ids:
            if 0 < block_id < self.num_blocks:
                self._uncache_into(self.blocks[block_id], removed)
        self._emit_removed(removed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        for cached in self.cached_by_group:
            cached.clear()
        # Nothing cached, so the LRU order means nothing any more: back to ascending ids, as at
        # start-up, so that new block tables are long runs of consecutive blocks (few, large
        # copies when KV is loaded into them).
        self.free_block_queue = FreeKVCacheBlockQueue()
        for block in self.blocks[1:]:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue.append_n(self.blocks[1:])
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    # -- allocation -----------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the free-queue head (evicting any cached content)."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks: {self.free_block_queue.num_free_blocks} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        removed: list[tuple[BlockHash, int]] = []
        for block in blocks:  # evicted in LRU order (and so reported)
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                self._uncache_into(block, removed)
            block.ref_cnt = 1
        self._emit_removed(removed)
        # Which blocks are evicted is the LRU's choice; which of them holds which position of
        # the block table is ours: ascending ids. Requests free their blocks tail-first, so
        # the queue holds descending runs; handed out as popped, every block of a new table
        # would be a run of its own, and a load into it one copy per block.
        blocks.sort(key=_block_id)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (prefix hits), pulling free ones out of the queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in order.

        Callers pass a request's blocks tail-first, so its shared prefix is evicted last.
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise AssertionError(f"freeing {block} which has no reference")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    # -- accounting -----------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out (free, cached or not)."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_usage(self) -> float:
        """Fraction of usable blocks in use (0.0 - 1.0)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_num_cached_blocks(self) -> int:
        return sum(len(v) for cached in self.cached_by_group for v in cached.values())

    def take_events(self) -> list[AnyKVEvent]:
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise AssertionError when the pool's bookkeeping is inconsistent."""
        null = self.null_block
        if null.block_hash is not None or null.prev_free_block or null.next_free_block:
            raise AssertionError(f"null block is cached or free: {null}")
        seen: set[int] = set()
        prev = self.free_block_queue._head
        for block in self.free_block_queue:
            if block.prev_free_block is not prev:
                raise AssertionError(f"free queue link broken at {block}")
            if block.block_id in seen or block.is_null:
                raise AssertionError(f"{block} is in the free queue twice or is the null block")
            if block.ref_cnt != 0:
                raise AssertionError(f"{block} is in the free queue but referenced")
            seen.add(block.block_id)
            prev = block
        if len(seen) != self.free_block_queue.num_free_blocks:
            raise AssertionError(
                f"free queue holds {len(seen)} blocks, counter says "
                f"{self.free_block_queue.num_free_blocks}"
            )
        in_use = 0
        cached_free = 0
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                raise AssertionError(f"{block} has a negative ref count")
            if block.ref_cnt > 0:
                in_use += 1
            elif block.block_id not in seen:
                raise AssertionError(f"{block} has no reference but is not in the free queue")
            if block.block_hash is not None:
                if not 0 <= block.group_idx < len(self.cached_by_group):
                    raise AssertionError(f"{block} is cached for an unknown group")
                holders = self.cached_by_group[block.group_idx].get(block.block_hash, {})
                if holders.get(block.block_id) is not block:
                    raise AssertionError(f"{block} has a hash but is not in the map under it")
                if block.ref_cnt == 0:
                    cached_free += 1
        num_free = len(seen)
        if num_free + in_use != self.num_usable_blocks:
            raise AssertionError(
                f"free ({num_free - cached_free} uncached + {cached_free} cached) + in use "
                f"({in_use}) != {self.num_usable_blocks} usable blocks"
            )
        for g, cached in enumerate(self.cached_by_group):
            for block_hash, holders in cached.items():
                if not holders:
                    raise AssertionError("empty holder set left in the map")
                for block_id, block in holders.items():
                    if (
                        block.block_id != block_id
                        or block.block_hash != block_hash
                        or block.group_idx != g
                    ):
                        raise AssertionError(f"group {g} map entry {block_id} -> {block} is stale")
