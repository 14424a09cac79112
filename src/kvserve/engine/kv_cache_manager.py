"""Per-request KV block tables on top of the block pool: prefix hits, allocation, freeing.

Owns ``request_id -> blocks`` and how many of a request's blocks are cached; the scheduler
decides *when* to allocate and free, the block pool *which* blocks. Never touches tensors.

Prefix-cache statistics count a request once per admission that succeeded: ``queries`` are the
tokens looked up, ``hits`` the tokens served from the pool. Lookups of a preempted request that
is admitted again go to the separate ``preempted_*`` counters (vLLM does the same), and a lookup
whose allocation failed (the request stays waiting and is looked up again next step) is not
counted at all. All counters are cumulative.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.engine.block_pool import BlockPool, KVCacheBlock
from kvserve.engine.request import Request
from kvserve.kv.events import MEDIUM_GPU, AnyKVEvent


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    """Block tables of the running requests of one engine (one full-attention layer group)."""

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
    ) -> None:
        """``block_pool``: an existing pool, or its size in blocks (also as ``num_blocks``).
        ``max_model_len`` defaults to what the whole pool can hold."""
        if block_pool is None:
            block_pool = num_blocks
        if block_pool is None:
            raise ValueError("give a block_pool or num_blocks")
        if isinstance(block_pool, int):
            block_pool = BlockPool(
                block_pool, enable_caching, block_size, enable_kv_cache_events, medium
            )
        if block_pool.block_size != block_size:
            raise ValueError("block pool and manager disagree on block_size")
        if max_model_len is None:
            max_model_len = block_pool.num_usable_blocks * block_size
        self.block_pool = block_pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request that are already in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Lookups waiting for their admission to succeed: request_id -> (queried, hit) tokens.
        self._pending_stats: dict[str, tuple[int, int]] = {}

    # -- capacity -------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def max_num_tokens(self) -> int:
        """KV slots in the whole pool: no request can ever hold more."""
        return self.num_usable_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # -- prefix hits ----------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request: (blocks, tokens). Leaves >= 1 token to compute.

        Only blocks lying entirely within the first ``num_tokens - 1`` tokens are considered,
        so a prompt of exactly k full blocks hits at most k - 1 blocks.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hit_tokens = len(blocks) * self.block_size
        self._pending_stats[request.request_id] = (request.num_tokens, num_hit_tokens)
        return blocks, num_hit_tokens

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
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give the request slots for ``num_new_tokens`` more tokens; None if the pool is short.

        ``new_computed_blocks`` (``num_new_computed_tokens`` tokens) are prefix hits from
        :meth:`get_computed_blocks`, ``num_external_computed_tokens`` tokens after them are to
        be filled by a KV connector. Hit blocks that are currently free count against free
        capacity. Returns the newly allocated blocks. Newly full blocks of the computed and
        scheduled tokens become hittable now unless ``delay_cache_blocks`` (their content is
        only valid later, e.g. after an asynchronous load).
        """
        if num_new_tokens < 0 or num_external_computed_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 unless loading external tokens")
        computed = new_computed_blocks or []
        if len(computed) * self.block_size != num_new_computed_tokens:
            raise ValueError(
                f"{num_new_computed_tokens} computed tokens do not match {len(computed)} blocks"
            )
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        if computed and req_blocks:
            raise ValueError(f"{rid}: prefix hits for a request that already holds blocks")
        num_held = len(req_blocks) if req_blocks else 0
        num_computed = (
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        )
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = max(cdiv(num_slots, self.block_size) - num_held - len(computed), 0)
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        if computed:
            self.block_pool.touch(computed)
            req_blocks.extend(computed)
            self.num_cached_block[rid] = len(computed)
        self._record_stats(request)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        # (in ascending id order: the pool hands out the blocks it evicts sorted)
        req_blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Make the request's full blocks within its first ``num_computed_tokens`` hittable."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(blocks))
        num_cached = self.num_cached_block.get(rid, 0)
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full)
        self.num_cached_block[rid] = num_full

    def uncache_from(self, request: Request, block_index: int) -> None:
        """Blocks from ``block_index`` on hold wrong KV: drop them from the cache and recompute
        (the blocks stay in the request's table)."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        self.block_pool.evict_blocks(
            b.block_id for b in blocks[block_index:] if b.block_hash is not None
        )
        if self.num_cached_block.get(rid, 0) > block_index:
            self.num_cached_block[rid] = block_index

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix outlives its tail."""
        rid = request.request_id
        self._pending_stats.pop(rid, None)
        self.num_cached_block.pop(rid, None)
        blocks = self.req_to_blocks.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def evict_blocks(self, block_ids: set[int] | list[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    # -- views ----------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks of this request shared by all ``num_running_requests`` requests."""
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
        """Pool invariants plus: every table's blocks are referenced, ref counts add up."""
        self.block_pool.check_integrity()
        refs: dict[int, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            for block in blocks:
                if block.is_null:
                    continue
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
            if self.num_cached_block.get(rid, 0) > len(blocks):
                raise AssertionError(f"{rid}: more cached blocks than blocks")
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise AssertionError(
                    f"{block}: ref count {block.ref_cnt} but {refs.get(block.block_id, 0)} "
                    "block tables hold it"
                )
