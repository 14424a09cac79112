"""Per-request KV block tables on top of the block pool: prefix hits, allocation, freeing.

The coordinator of the KV cache groups (:mod:`kvserve.engine.kv_cache_spec`): one
:mod:`single-type manager <kvserve.engine.single_type_managers>` per group owns that group's
``request_id -> blocks``; this class computes the prefix hit every group agrees on, allocates
for all groups at once (atomically: all or nothing) and frees them together. The scheduler
decides *when* to allocate and free, the block pool *which* blocks. Never touches tensors.

A prefix hit of L tokens (block-aligned) needs the full-attention groups to hold blocks
``[0, L)`` and each sliding-window group the blocks covering ``[L - window + 1, L)``: the full
groups give the longest L, each sliding group shortens it to the longest end where it holds
its window, until every group agrees. Single-group models (pure full attention, or a window
in every layer) take the same path with one group.

Prefix-cache statistics count a request once per admission that succeeded: ``queries`` are the
tokens looked up, ``hits`` the tokens served from the pool. Lookups of a preempted request that
is admitted again go to the separate ``preempted_*`` counters (vLLM does the same), and a lookup
whose allocation failed (the request stays waiting and is looked up again next step) is not
counted at all. All counters are cumulative.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvserve.engine.block_pool import BlockPool, KVCacheBlock
from kvserve.engine.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    cdiv,
)
from kvserve.engine.request import Request
from kvserve.engine.single_type_managers import SingleTypeKVCacheManager, make_manager
from kvserve.kv.events import MEDIUM_GPU, AnyKVEvent

# Blocks of each KV cache group (group order), e.g. the prefix hits of a request.
KVCacheBlocks = tuple[list[KVCacheBlock], ...]

__all__ = ["KVCacheBlocks", "KVCacheManager", "PrefixCacheStats", "cdiv"]


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters of the primary pool (tokens)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Block tables of the running requests of one engine, for every KV cache group."""

    def __init__(
        self,
        block_pool: BlockPool | int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = True,
        medium: str = MEDIUM_GPU,
        *,
        num_blocks: int | None = None,
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """``block_pool``: an existing pool, or its size in blocks (also as ``num_blocks``).
        ``max_model_len`` defaults to what the whole pool can hold. ``kv_cache_groups``: the
        model's groups (default: one full-attention group). ``max_num_batched_tokens``: the
        longest prefill chunk (bounds what a sliding group holds; default: unbounded)."""
        if block_pool is None:
            block_pool = num_blocks
        if block_pool is None:
            raise ValueError("give a block_pool or num_blocks")
        groups = list(kv_cache_groups or [KVCacheGroupSpec((0,), FullAttentionSpec())])
        specs = [g.spec for g in groups]
        if isinstance(block_pool, int):
            block_pool = BlockPool(
                block_pool, enable_caching, block_size, enable_kv_cache_events, medium, specs
            )
        if block_pool.block_size != block_size:
            raise ValueError("block pool and manager disagree on block_size")
        if len(block_pool.group_specs) != len(groups):
            raise ValueError("block pool and manager disagree on the KV cache groups")
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv_cache_groups = groups
        self.num_groups = len(groups)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(g.spec, i, block_pool) for i, g in enumerate(groups)
        ]
        self.full_managers = [m for m in self.managers if not isinstance(m.spec, SlidingWindowSpec)]
        self.sliding_managers = [m for m in self.managers if isinstance(m.spec, SlidingWindowSpec)]
        # Group 0's tables: the whole table of a single-group model (and the key set of every
        # group's tables).
        self.req_to_blocks = self.managers[0].req_to_blocks
        self.num_cached_block = self.managers[0].num_cached_block
        # References a KV connector holds on blocks it still reads (block id -> count).
        self._pins: dict[int, int] = {}
        self.sliding_hold_tokens = 0
        if max_model_len is None:
            max_model_len = self.max_num_tokens
        self.max_model_len = max_model_len
        self.prefix_cache_stats = PrefixCacheStats()
        # Lookups waiting for their admission to succeed: request_id -> (queried, hit) tokens.
        self._pending_stats: dict[str, tuple[int, int]] = {}

    def set_sliding_hold(self, tokens: int) -> None:
        """Sliding-window groups free blocks only in whole runs of ``tokens`` (a multiple of
        the block size: an offload chunk), once the run is complete: its store is planned
        while every block of it is still in the table."""
        if tokens % self.block_size:
            raise ValueError("the hold must be a multiple of the block size")
        self.sliding_hold_tokens = tokens
        for m in self.sliding_managers:
            m.hold_blocks = tokens // self.block_size

    def pin_blocks(self, block_ids: list[int]) -> None:
        """Take a reference on blocks a connector still reads (a store in flight): freed by
        their tables (a window moving on) they stay allocated until :meth:`unpin_blocks`."""
        blocks = self.block_pool.blocks
        self.block_pool.touch(blocks[i] for i in block_ids)
        pins = self._pins
        for i in block_ids:
            pins[i] = pins.get(i, 0) + 1

    def unpin_blocks(self, block_ids: list[int]) -> None:
        blocks = self.block_pool.blocks
        pins = self._pins
        for i in block_ids:
            n = pins.get(i, 0)
            if n <= 0:
                raise AssertionError(f"unpinning block {i}, which is not pinned")
            if n == 1:
                del pins[i]
            else:
                pins[i] = n - 1
        self.block_pool.free_blocks(blocks[i] for i in block_ids)

    # -- capacity -------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    def max_blocks_for(self, num_tokens: int) -> int:
        """Most blocks (all groups) one request of ``num_tokens`` tokens holds at once."""
        bs = self.block_size
        chunk = (self.max_num_batched_tokens or num_tokens) + self.sliding_hold_tokens
        return sum(g.spec.max_blocks(num_tokens, bs, chunk) for g in self.kv_cache_groups)

    @property
    def max_num_tokens(self) -> int:
        """Longest request the whole pool can hold: none can ever hold more tokens' KV."""
        usable, bs = self.num_usable_blocks, self.block_size
        if self.num_groups == 1 and not self.sliding_managers:
            return usable * bs
        # max_blocks_for is non-decreasing in the token count: largest fitting block count.
        lo, hi = 0, usable * bs
        if self.max_blocks_for(hi) <= usable:
            return hi if self.full_managers else 1 << 40
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.max_blocks_for(mid) <= usable else (lo, mid)
        return lo

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # -- prefix hits ----------------------------------------------------------------------
    def empty_blocks(self) -> KVCacheBlocks:
        return tuple([] for _ in self.managers)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of the request every group agrees on: (blocks per group,
        tokens). Leaves >= 1 token to compute.

        Only blocks lying entirely within the first ``num_tokens - 1`` tokens are considered,
        so a prompt of exactly k full blocks hits at most k - 1 blocks.
        """
        if not self.enable_caching:
            return self.empty_blocks(), 0
        bs = self.block_size
        hashes = request.block_hashes
        max_hit = (request.num_tokens - 1) // bs
        if self.num_groups == 1:
            blocks = self.managers[0].find_longest_cache_hit(hashes, max_hit)
            hit = len(blocks)
            result: KVCacheBlocks = (blocks,)
        else:
            found: dict[int, list[KVCacheBlock]] = {}
            hit = max_hit
            for m in self.full_managers:
                found[m.group_idx] = m.find_longest_cache_hit(hashes, hit)
                hit = min(hit, len(found[m.group_idx]))
            # Each sliding group may shorten the hit; another group's shorter hit can undo a
            # sliding group's window, so repeat until no group shortens it (the hit only
            # decreases: this ends).
            changed = bool(self.sliding_managers)
            while changed and hit > 0:
                changed = False
                for m in self.sliding_managers:
                    got = found.get(m.group_idx)
                    if got is not None and len(got) == hit:
                        continue
                    got = found[m.group_idx] = m.find_longest_cache_hit(hashes, hit)
                    if len(got) < hit:
                        hit, changed = len(got), True
            result = tuple(
                found[i][:hit] if hit and i in found else [] for i in range(self.num_groups)
            )
        num_hit_tokens = hit * bs
        self._pending_stats[request.request_id] = (request.num_tokens, num_hit_tokens)
        return result, num_hit_tokens

    def _record_stats(self, request: Request) -> None:
        pending = self._pending_stats.pop(request.request_id, None)
        if pending is None:
            return
        queried, hit = pending
        s = self.prefix_cache_stats
        if request.num_preemptions > 0:
            s.preempted_requests += 1
            s.preempted_queries += queried
            s.preempted_hits += hit
        else:
            s.requests += 1
            s.queries += queried
            s.hits += hit

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """A snapshot of the cumulative counters."""
        return replace(self.prefix_cache_stats)

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give the request slots for ``num_new_tokens`` more tokens in every group; None
        (and nothing allocated) if the pool is short.

        ``new_computed_blocks`` (``num_new_computed_tokens`` tokens) are prefix hits from
        :meth:`get_computed_blocks` (a plain list: group 0's, for a single-group model),
        ``num_external_computed_tokens`` tokens after them are to be filled by a KV
        connector. Hit blocks that are currently free count against free capacity; blocks a
        sliding window no longer reads are freed first. Returns the newly allocated blocks
        (all groups). Newly full blocks of the computed and scheduled tokens become hittable
        now unless ``delay_cache_blocks`` (their content is only valid later, e.g. after an
        asynchronous load).
        """
        if num_new_tokens < 0 or num_external_computed_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 unless loading external tokens")
        if not new_computed_blocks:
            computed = None
        elif isinstance(new_computed_blocks, list):
            computed = (new_computed_blocks,)
        else:
            computed = new_computed_blocks
        if computed is not None:
            if len(computed) != self.num_groups or any(
                len(c) * self.block_size != num_new_computed_tokens for c in computed
            ):
                raise ValueError(
                    f"{num_new_computed_tokens} computed tokens do not match the hit blocks"
                )
            if not computed[0] and num_new_computed_tokens == 0:
                computed = None
        elif num_new_computed_tokens:
            raise ValueError(f"{num_new_computed_tokens} computed tokens but no hit blocks")
        rid = request.request_id
        managers = self.managers
        held = rid in self.req_to_blocks
        if computed is not None and held and self.req_to_blocks[rid]:
            raise ValueError(f"{rid}: prefix hits for a request that already holds blocks")
        num_computed = (
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        )
        if held and self.sliding_managers:
            for m in self.sliding_managers:
                m.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if computed is None and self.num_groups == 1:  # a running request's next tokens
            table = self.req_to_blocks.get(rid)
            need = cdiv(num_slots, self.block_size) - (len(table) if table else 0)
        else:
            empty: list[KVCacheBlock] = []
            need = 0
            for i, m in enumerate(managers):
                new, hits = m.get_num_blocks_to_allocate(
                    rid, num_slots, computed[i] if computed is not None else empty, num_computed
                )
                need += new + hits
        if need > 0 and need > self.block_pool.get_num_free_blocks():
            return None

        if computed is not None:
            for i, m in enumerate(managers):
                m.save_computed_blocks(rid, computed[i], num_computed)
        self._record_stats(request)
        if self.num_groups == 1:
            new_blocks = managers[0].allocate_new_blocks(rid, num_slots, num_computed)
        else:
            new_blocks = []
            for m in managers:
                new_blocks += m.allocate_new_blocks(rid, num_slots, num_computed)
        if not delay_cache_blocks:
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Make the request's full blocks within its first ``num_computed_tokens`` hittable."""
        if not self.enable_caching:
            return
        n = min(num_computed_tokens, request.num_tokens)
        for m in self.managers:
            m.cache_blocks(request, n)

    def uncache_from(self, request: Request, block_index: int) -> None:
        """Blocks from ``block_index`` on (every group) hold wrong KV: drop them from the
        cache and recompute (the blocks stay in the request's tables)."""
        for m in self.managers:
            m.uncache_from(request.request_id, block_index)

    def can_resume_at(self, request_id: str, num_tokens: int) -> bool:
        """The request can compute on from token ``num_tokens`` with the blocks it holds:
        every sliding group holds real blocks from the window a query there reads onwards
        (entries a window no longer read are the null block: never written, never read)."""
        for m in self.sliding_managers:
            first = m.num_skipped_blocks(num_tokens)
            if any(b.is_null for b in m.req_to_blocks.get(request_id, [])[first:]):
                return False
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix outlives its tail."""
        rid = request.request_id
        self._pending_stats.pop(rid, None)
        for m in reversed(self.managers):
            m.free(rid)

    def evict_blocks(self, block_ids: set[int] | list[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    # -- views ----------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """Group 0's table (the whole table of a single-group model)."""
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block ids (see :meth:`get_group_block_ids` for every group)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Block ids of every group's table (0: the null block a window no longer reads)."""
        return [[b.block_id for b in m.req_to_blocks.get(request_id, [])] for m in self.managers]

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks of this request (group 0) shared by all running requests."""
        n = 0
        for block in self.req_to_blocks.get(request_id, []):
            if block.ref_cnt != num_running_requests:
                break
            n += 1
        return n

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.prefix_cache_stats.resets += 1
        return ok

    def take_events(self) -> list[AnyKVEvent]:
        return self.block_pool.take_events()

    def check_integrity(self) -> None:
        """Pool invariants plus: every table's blocks are referenced, ref counts add up,
        every group has a table for the same requests, and a sliding group's null entries
        are a prefix of its table."""
        self.block_pool.check_integrity()
        refs: dict[int, int] = dict(self._pins)
        rids = set(self.req_to_blocks)
        for m in self.managers:
            if set(m.req_to_blocks) != rids:
                raise AssertionError(f"group {m.group_idx} has tables of other requests")
            for rid, blocks in m.req_to_blocks.items():
                seen_block = False
                for block in blocks:
                    if block.is_null:
                        if seen_block or m.spec.sliding_window is None:
                            raise AssertionError(f"{rid}: null block inside group {m.group_idx}")
                        continue
                    seen_block = True
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
                if m.num_cached_block.get(rid, 0) > len(blocks):
                    raise AssertionError(f"{rid}: more cached blocks than blocks")
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise AssertionError(
                    f"{block}: ref count {block.ref_cnt} but {refs.get(block.block_id, 0)} "
                    "block tables and pins hold it"
                )
