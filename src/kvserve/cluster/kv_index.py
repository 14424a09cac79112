"""The router's cluster KV index: which endpoint holds which block, on which medium.

Owns the block key -> (endpoint, media) state fed by KV events. Keys are recomputed from each
``BlockStored``'s ``token_ids`` and parent chain with :mod:`kvserve.engine.hashing` (the
router's seed, the event's block size), so an engine's own hash function and seed never
matter; each endpoint keeps a map from its hashes to index keys, used to resolve
``parent_block_hash`` and ``BlockRemoved``. Storage is per endpoint (one LRU-bounded ordered
map each), which keeps an entry small and lets a prompt be matched against one endpoint with
C-level dict probes. Thread-safe: events are applied by the subscriber thread while the
gateway scores requests.

A block stored twice under one hash on one medium (engines may hold duplicates) must be
removed twice before it is gone, as the engine's own pool behaves.

Shared storage tiers (events with ``medium="STORAGE"``, ``shared=True`` and a ``tier`` id, as
kvserve engines publish for a shared file system or Redis/Valkey tier) are indexed twice: for
the publishing endpoint, and under a virtual holder for the tier itself. Every endpoint that
published an event of that tier is a member of it, and a block the tier holds counts for every
member at the tier's weight, whoever wrote it: a prefix computed on one instance is a hit
(a cheaper one than GPU) on every instance that can load it.

KV cache groups (hybrid models; :mod:`kvserve.cluster.kv_groups` owns the layout and the
rule). An engine publishes each group's blocks with ``group_idx``, ``kv_cache_spec_kind`` and,
for a sliding window, ``kv_cache_spec_sliding_window``; all groups share one hash chain, so
a block keeps one entry whose mask holds every group's media. A prefix of L blocks is a hit
when every full-attention group holds blocks [0, L) and every sliding group the window
before L; the hit is the largest such L, each block weighted by the worst tier among the
groups that need it. For an endpoint with full-attention groups, its bit in the holder map
means "every full-attention group holds the block", so the one pass over the prompt finds
their run for all endpoints at once and only the windows below it are probed. Sliding-only
models, and models with several full-attention groups that use shared tiers, are matched
one endpoint at a time. An endpoint whose
events carry only group 0 with full attention (vLLM's non-hybrid models, older publishers)
is matched exactly as before groups existed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat

import msgspec

from kvserve.cluster.kv_groups import (
    FULL_ATTENTION,
    GROUP_SHIFT,
    MAX_GROUPS,
    MEDIA_MASK,
    GroupLayout,
    candidates_by_bits,
    event_window,
    full_run,
    masks_of,
    sliding_hit,
    window_cost,
)
from kvserve.engine.hashing import DEFAULT_PREFIX_HASH_SEED, encode_tokens, hash_block, seed_hash
from kvserve.kv.events import AllBlocksCleared, AnyKVEvent, BlockRemoved, BlockStored

logger = logging.getLogger(__name__)

# One bit per medium; an entry's mask says where the endpoint holds the block.
MEDIUM_BITS: dict[str, int] = {"GPU": 1, "CPU": 2, "DISK": 4, "FS": 8, "REDIS": 16}
OTHER_MEDIUM_BIT = 32
_ALL_BITS = 64

# Relative value of a hit per tier (a GPU hit is free; lower tiers cost a load).
DEFAULT_TIER_WEIGHTS: dict[str, float] = {
    "GPU": 1.0,
    "CPU": 0.8,
    "DISK": 0.6,
    "FS": 0.5,
    "REDIS": 0.5,
    "OTHER": 0.5,
}


def medium_bit(medium: str | None, tier: str | None = None) -> int:
    """Bit of a medium name; ``None`` (vLLM's default) is the primary pool, GPU. vLLM's
    ``STORAGE`` is told apart by kvserve's ``tier`` (``disk``, ``fs:...``, ``redis://...``)."""
    if medium is None:
        return 1
    medium = medium.upper()
    if medium == "STORAGE":
        kind = (tier or "").split(":", 1)[0].lower()
        if kind == "disk":
            return MEDIUM_BITS["DISK"]
        if kind == "fs":
            return MEDIUM_BITS["FS"]
        if kind in ("redis", "rediss", "valkey", "valkeys", "unix"):
            return MEDIUM_BITS["REDIS"]
        return OTHER_MEDIUM_BIT
    return MEDIUM_BITS.get(medium, OTHER_MEDIUM_BIT)


def mask_weights(tier_weights: dict[str, float]) -> list[float]:
    """Weight of a block for every media mask: the best medium holding it."""
    unknown = set(tier_weights) - set(MEDIUM_BITS) - {"OTHER"}
    if unknown:
        raise ValueError(f"unknown media in tier_weights: {sorted(unknown)}")
    by_bit = {
        bit: tier_weights.get(name, DEFAULT_TIER_WEIGHTS[name]) for name, bit in MEDIUM_BITS.items()
    }
    by_bit[OTHER_MEDIUM_BIT] = tier_weights.get("OTHER", DEFAULT_TIER_WEIGHTS["OTHER"])
    for w in by_bit.values():
        if not 0.0 <= w <= 1.0:
            raise ValueError("tier weights must be in [0, 1]")
    out = [0.0] * _ALL_BITS
    for mask in range(1, _ALL_BITS):
        out[mask] = max(w for bit, w in by_bit.items() if mask & bit)
    return out


class _Entry(msgspec.Struct, gc=False):
    """One block held by one endpoint. A C-level struct, untracked by the garbage collector:
    an index holds millions and creates ~100k a second."""

    engine_hash: int
    key: int
    key_bytes: bytes  # our full hash: the parent of the next block
    mask: int  # media bits
    dups: dict[int, int] | None = None  # extra copies per medium bit

    def add(self, bit: int) -> None:
        if self.mask & bit:
            if self.dups is None:
                self.dups = {}
            self.dups[bit] = self.dups.get(bit, 0) + 1
        else:
            self.mask |= bit

    def remove(self, bit: int) -> bool:
        """Drop one copy on ``bit``; False if the medium did not hold it."""
        if self.dups and self.dups.get(bit):
            self.dups[bit] -= 1
            return True
        if self.mask & bit:
            self.mask &= ~bit
            return True
        return False


class _EndpointBlocks:
    __slots__ = (
        "bit",
        "block_size",
        "by_engine",
        "by_key",
        "ghosts",
        "groups",
    )

    def __init__(self, bit: int) -> None:
        self.bit = bit  # this endpoint's bit in the holder masks
        self.block_size: int | None = None
        self.groups = GroupLayout()  # the KV groups its events declared
        self.by_engine: dict[int, _Entry] = {}
        self.by_key: OrderedDict[int, _Entry] = OrderedDict()  # LRU order: oldest first
        # Engine hash -> key bytes of blocks no longer held, to resolve late parents.
        self.ghosts: OrderedDict[int, bytes] = OrderedDict()


@dataclass
class IndexStats:
    blocks: int = 0  # entries held (block x endpoint)
    stored_blocks: int = 0  # block store events applied
    removed_blocks: int = 0  # block removal events applied
    evicted_blocks: int = 0  # entries dropped by the size bound
    unresolved_parents: int = 0  # stored blocks skipped: parent hash unknown
    unknown_removals: int = 0  # removals of blocks the index did not hold
    skipped_events: int = 0  # malformed or not indexed (e.g. a kind of group we cannot score)
    layout_changes: int = 0  # an endpoint's group changed kind or window: endpoint cleared
    clears: int = 0


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low
        mask ^= low


class KVIndex:
    """Block key -> endpoints and media, per endpoint bounded by ``max_blocks_per_endpoint``.

    Besides each endpoint's own maps, two shared maps make matching one pass over the
    prompt whatever the number of endpoints: key -> bitmask of the endpoints holding it, and
    key -> bitmask of those holding it only below GPU (empty unless lower tiers publish).
    """

    def __init__(
        self,
        *,
        seed: str = DEFAULT_PREFIX_HASH_SEED,
        max_blocks_per_endpoint: int = 2_000_000,
        tier_weights: dict[str, float] | None = None,
        max_ghosts_per_endpoint: int = 65536,
    ) -> None:
        if max_blocks_per_endpoint < 1:
            raise ValueError("max_blocks_per_endpoint must be >= 1")
        self.seed = seed
        self.max_blocks_per_endpoint = max_blocks_per_endpoint
        self.max_ghosts_per_endpoint = max_ghosts_per_endpoint
        self.mask_weights = mask_weights(tier_weights or {})
        self._root = seed_hash(seed)
        self._endpoints: dict[str, _EndpointBlocks] = {}
        self._by_bit: dict[int, _EndpointBlocks] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1
        self._holders: dict[int, int] = {}
        self._lower: dict[int, int] = {}
        # Shared storage tiers: tier id -> its virtual holder; holder bit -> member endpoints.
        self._tiers: dict[str, _EndpointBlocks] = {}
        self._tier_members: dict[int, int] = {}
        self._tier_bits = 0
        self._lock = threading.Lock()
        self.stats = IndexStats()

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return self.stats.blocks

    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._endpoints)

    def endpoint_block_size(self, endpoint: str) -> int | None:
        ep = self._endpoints.get(endpoint)
        return ep.block_size if ep else None

    def endpoint_num_blocks(self, endpoint: str) -> int:
        ep = self._endpoints.get(endpoint)
        return len(ep.by_key) if ep else 0

    def endpoint_keys(self, endpoint: str) -> set[int]:
        """Every block key held by ``endpoint`` (tests, debugging)."""
        with self._lock:
            ep = self._endpoints.get(endpoint)
            return set(ep.by_key) if ep else set()

    def endpoint_layout(self, endpoint: str) -> dict[int, int]:
        """KV groups ``endpoint`` published: group id -> sliding window (0: full attention)."""
        with self._lock:
            ep = self._endpoints.get(endpoint)
            return dict(ep.groups.windows) if ep else {}

    def media(self, endpoint: str, key: int, group: int = 0) -> set[str]:
        """Media on which ``endpoint``'s KV group ``group`` holds block ``key``."""
        with self._lock:
            ep = self._endpoints.get(endpoint)
            entry = ep.by_key.get(key) if ep else None
            if entry is None:
                return set()
            mask = (entry.mask >> GROUP_SHIFT * group) & MEDIA_MASK
            names = {n for n, b in MEDIUM_BITS.items() if mask & b}
            if mask & OTHER_MEDIUM_BIT:
                names.add("OTHER")
            return names

    def match(self, endpoint: str, keys: Sequence[int]) -> tuple[int, float]:
        """Longest run of ``keys`` from block 0 held by ``endpoint``: (blocks, tier-weighted)."""
        with self._lock:
            ep = self._endpoints.get(endpoint)
            if ep is None or not ep.by_key:
                return 0, 0.0
            if ep.groups.grouped and self._exact_only(ep):
                return self._grouped_match(ep, keys)
            n, w = self._runs(keys, ep.bit)[ep.bit]
            return self._windows(ep, keys, n, w) if ep.groups.grouped else (n, w)

    def match_endpoints(
        self, endpoints: Iterable[str], keys_for: Callable[[int], Sequence[int]]
    ) -> dict[str, tuple[int, float, int]]:
        """For each endpoint: (matched blocks, weighted blocks, prompt blocks).

        ``keys_for(block_size)`` gives the prompt's keys for a block size (callers memoize
        it: endpoints usually share one block size, so the prompt is hashed once).
        """
        endpoints = list(endpoints)
        out: dict[str, tuple[int, float, int]] = {}
        # Hash outside the lock (a long prompt takes milliseconds; ingestion must not wait).
        sizes = {self.endpoint_block_size(n) for n in endpoints}
        keys_by_size = {bs: keys_for(bs) for bs in sizes if bs}
        with self._lock:
            groups: dict[int, int] = {}
            names: dict[int, tuple[str, _EndpointBlocks]] = {}
            exact: list[tuple[str, _EndpointBlocks]] = []  # matched one by one
            for name in endpoints:
                ep = self._endpoints.get(name)
                if ep is None or ep.block_size not in keys_by_size or not ep.by_key:
                    out[name] = (0, 0.0, 0)
                    continue
                if ep.groups.grouped and self._exact_only(ep):
                    exact.append((name, ep))
                    continue
                groups[ep.block_size] = groups.get(ep.block_size, 0) | ep.bit
                names[ep.bit] = (name, ep)
            for bs, alive in groups.items():
                keys = keys_by_size[bs]
                for bit, (n, w) in self._runs(keys, alive).items():
                    name, ep = names[bit]
                    if ep.groups.grouped:  # the run is the full-attention groups': fit the windows
                        n, w = self._windows(ep, keys, n, w)
                    out[name] = (n, w, len(keys))
            if exact:
                for bs in {ep.block_size for _, ep in exact}:
                    keys = keys_by_size[bs]
                    eps = [ep for _, ep in exact if ep.block_size == bs]
                    ends = self._ends(keys, [ep for ep in eps if not ep.groups.full_shifts])
                    for name, ep in exact:
                        if ep.block_size == bs:
                            hit = self._grouped_match(ep, keys, ends.get(ep.bit))
                            out[name] = (*hit, len(keys))
        return out

    def _runs(self, keys: Sequence[int], alive: int) -> dict[int, tuple[int, float]]:
        """Run length and weighted run, from block 0, of every endpoint bit in ``alive``."""
        holders, lower = self._holders, self._lower
        tier_bits, members = self._tier_bits, self._tier_members
        runs: dict[int, int] = {}
        penalty: dict[int, float] = {}
        i = -1
        for i, k in enumerate(keys):  # noqa: B007 - i is used after the loop
            m = holders.get(k, 0)
            if m & tier_bits:  # in a shared tier: held for every member too
                w, by_bit = self.mask_weights, self._by_bit
                for tb in _bits(m & tier_bits):
                    via = members.get(tb, 0) & alive & ~m
                    if via:
                        tier = by_bit[tb]
                        cost = tier.groups.full_cost(tier.by_key[k].mask, w)
                        for b in _bits(via):
                            penalty[b] = penalty.get(b, 0.0) + cost
                        m |= via
            m &= alive
            if m != alive:
                for b in _bits(alive ^ m):
                    runs[b] = i
                alive = m
                if not alive:
                    break
            if lower:
                low = lower.get(k, 0) & alive
                if low:  # held below GPU only: a hit worth its tier's weight
                    w = self.mask_weights
                    for b in _bits(low):
                        holder = self._by_bit[b]
                        penalty[b] = penalty.get(b, 0.0) + holder.groups.full_cost(
                            holder.by_key[k].mask, w
                        )
        else:
            for b in _bits(alive):
                runs[b] = i + 1
        return {b: (n, n - penalty.get(b, 0.0)) for b, n in runs.items()}

    def _exact_only(self, ep: _EndpointBlocks) -> bool:
        """Matched on its own, not in the one pass: a model with sliding windows only
        (nothing bounds its hit from block 0), or with several full-attention groups and
        shared tiers (a block may be held by the endpoint for one group, by a tier for
        another: the one pass sees only who holds all of them)."""
        full = ep.groups.full_shifts
        return not full or (len(full) > 1 and any(m & ep.bit for m in self._tier_members.values()))

    def _maps(self, ep: _EndpointBlocks) -> list[OrderedDict[int, _Entry]]:
        """``ep``'s block map and those of the shared tiers it can load from."""
        return [ep.by_key] + [
            self._by_bit[tb].by_key
            for tb, members in self._tier_members.items()
            if members & ep.bit and self._by_bit[tb].by_key
        ]

    def _windows(
        self, ep: _EndpointBlocks, keys: Sequence[int], top: int, weighted: float
    ) -> tuple[int, float]:
        """Fit the sliding windows below the full-attention groups' run ``top`` (weighted:
        ``weighted``) that the one pass found; each block below ``top`` is held by ``ep`` or
        a shared tier of it."""
        if not top:
            return 0, 0.0
        layout, w = ep.groups, self.mask_weights
        maps = self._maps(ep)
        if len(maps) == 1:
            get = ep.by_key.__getitem__

            def mask_at(i: int) -> int:
                return get(keys[i]).mask

        else:

            def mask_at(i: int) -> int:
                k, m = keys[i], 0
                for t in maps:
                    e = t.get(k)
                    if e is not None:
                        m |= e.mask
                return m

        def candidates() -> list[int]:
            return candidates_by_bits(layout.sliding_bits, masks_of(maps, keys[:top]))

        sliding = layout.sliding(ep.block_size or 1)
        hit = sliding_hit(sliding, top, mask_at, candidates)
        if not hit:
            return 0, 0.0
        cost = top - weighted
        if cost > 0.0 and hit < top:  # the blocks cut off took their tier cost with them
            cost -= layout.full_costs(masks_of(maps, keys[hit:top]), w)
        cost += window_cost(layout, w, hit, sliding, mask_at)
        return hit, hit - max(cost, 0.0)

    def _ends(self, keys: Sequence[int], eps: list[_EndpointBlocks]) -> dict[int, int]:
        """Endpoint bit -> 1 + the last block of ``keys`` each of ``eps`` holds at all (itself
        or through a shared tier), 0 for none: one backward pass for all of them, the bound
        of a sliding-only model's hit."""
        tiers = self._tier_members.items()
        counts = {ep.bit: ep.bit | sum(tb for tb, m in tiers if m & ep.bit) for ep in eps}
        out = dict.fromkeys(counts, 0)
        left = 0
        for bits in counts.values():
            left |= bits
        get = self._holders.get
        for i in range(len(keys) - 1, -1, -1):
            m = get(keys[i], 0) & left
            if m:
                for b, bits in list(counts.items()):
                    if m & bits:
                        out[b] = i + 1
                        del counts[b]
                if not counts:
                    break
                left = 0
                for bits in counts.values():
                    left |= bits
        return out

    def _grouped_match(
        self, ep: _EndpointBlocks, keys: Sequence[int], end: int | None = None
    ) -> tuple[int, float]:
        """The hybrid rule for one endpoint on its own (with its shared tiers' copies): the
        full-attention groups bound the hit (a run from block 0), then the sliding windows
        are fitted below it. ``end``: a bound of a sliding-only model's hit (:meth:`_ends`)."""
        layout, w = ep.groups, self.mask_weights
        maps = self._maps(ep)
        masks: list[int] = []
        if layout.full_shifts:
            masks = full_run(layout, maps, keys)
            top = len(masks)
            mask_at = masks.__getitem__

            def candidates() -> list[int]:
                return candidates_by_bits(layout.sliding_bits, masks)

        else:  # sliding windows only: the hit may end anywhere, blocks are read as needed
            if not any(need for _, need in layout.sliding(ep.block_size or 1)):
                top = len(keys)  # windows of one token: nothing is needed before a hit
            else:  # the hit ends on a block every sliding group holds
                top = self._ends(keys, [ep])[ep.bit] if end is None else end
            memo: dict[int, int] = {}

            def mask_at(i: int) -> int:
                m = memo.get(i)
                if m is None:
                    k, m = keys[i], 0
                    for t in maps:
                        e = t.get(k)
                        if e is not None:
                            m |= e.mask
                    memo[i] = m
                return m

            def candidates() -> list[int]:
                return candidates_by_bits(-1, masks_of(maps, keys[:top]))  # held at all

        sliding = layout.sliding(ep.block_size or 1)
        hit = sliding_hit(sliding, top, mask_at, candidates)
        if not hit:
            return 0, 0.0
        cost = layout.full_costs(masks[:hit], w) if layout.full_shifts else 0.0
        cost += window_cost(layout, w, hit, sliding, mask_at)
        return hit, hit - max(cost, 0.0)

    # ------------------------------------------------------------------ updates

    def apply_events(self, endpoint: str, events: Iterable[AnyKVEvent]) -> int:
        """Apply one batch's events of ``endpoint`` in order; returns block events applied."""
        n = 0
        with self._lock:
            ep = self._endpoints.get(endpoint)
            if ep is None:
                ep = self._add_endpoint(endpoint)
            for ev in events:
                if isinstance(ev, BlockStored):
                    n += self._store(ep, ev)
                    if ev.shared and ev.tier:
                        self._store(self._shared_tier(ev.tier, ep), ev, fallback=ep)
                elif isinstance(ev, BlockRemoved):
                    n += self._remove(ep, ev)
                    if ev.shared and ev.tier:
                        self._remove(self._shared_tier(ev.tier, ep), ev)
                elif isinstance(ev, AllBlocksCleared):
                    self._clear(ep)
                    self.stats.clears += 1
                else:  # pragma: no cover - decode_batch only yields the three types
                    self.stats.skipped_events += 1
        return n

    def clear_endpoint(self, endpoint: str) -> None:
        with self._lock:
            ep = self._endpoints.get(endpoint)
            if ep is not None:
                self._clear(ep)

    def remove_endpoint(self, endpoint: str) -> None:
        """Forget an endpoint that went away."""
        with self._lock:
            ep = self._endpoints.pop(endpoint, None)
            if ep is not None:
                self._clear(ep)
                del self._by_bit[ep.bit]
                self._free_bits.append(ep.bit)
                for tb in self._tier_members:
                    self._tier_members[tb] &= ~ep.bit

    def add_tier_member(self, endpoint: str, tier: str) -> None:
        """``endpoint`` can load from shared tier ``tier`` (from configuration; events teach
        it too)."""
        with self._lock:
            ep = self._endpoints.get(endpoint) or self._add_endpoint(endpoint)
            self._shared_tier(tier, ep)

    def tier_members(self, tier: str) -> list[str]:
        with self._lock:
            holder = self._tiers.get(tier)
            mask = self._tier_members.get(holder.bit, 0) if holder else 0
            return [n for n, ep in self._endpoints.items() if ep.bit & mask]

    def _shared_tier(self, tier: str, member: _EndpointBlocks) -> _EndpointBlocks:
        """The virtual holder of shared tier ``tier``, with ``member`` among its members."""
        holder = self._tiers.get(tier)
        if holder is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = self._next_bit, self._next_bit << 1
            holder = self._tiers[tier] = self._by_bit[bit] = _EndpointBlocks(bit)
            self._tier_bits |= bit
        self._tier_members[holder.bit] = self._tier_members.get(holder.bit, 0) | member.bit
        return holder

    def _add_endpoint(self, endpoint: str) -> _EndpointBlocks:
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit, self._next_bit = self._next_bit, self._next_bit << 1
        ep = self._endpoints[endpoint] = self._by_bit[bit] = _EndpointBlocks(bit)
        return ep

    def _unindex(self, ep: _EndpointBlocks) -> None:
        """Take ``ep``'s bit out of the holder and lower-tier maps (its entries stay)."""
        bit, keep = ep.bit, ~ep.bit
        for table in (self._holders, self._lower):
            for key in ep.by_key:
                m = table.get(key, 0)
                if m & bit:
                    m &= keep
                    if m:
                        table[key] = m
                    else:
                        del table[key]

    def _clear(self, ep: _EndpointBlocks) -> None:
        self._unindex(ep)
        self.stats.blocks -= len(ep.by_key)
        ep.by_engine.clear()
        ep.by_key.clear()
        ep.ghosts.clear()

    def _store(
        self, ep: _EndpointBlocks, ev: BlockStored, fallback: _EndpointBlocks | None = None
    ) -> int:
        """Index ``ev``'s blocks for ``ep``; a parent unknown to ``ep`` is resolved through
        ``fallback`` (the publisher, for a shared tier's holder)."""
        bs = ev.block_size
        hashes = ev.block_hashes
        tokens = ev.token_ids
        n = len(hashes)
        group = ev.group_idx
        # A kind the rule cannot score (or a sliding window without its size): not indexed.
        kind = ev.kv_cache_spec_kind
        window = (
            0 if kind == FULL_ATTENTION else event_window(kind, ev.kv_cache_spec_sliding_window)
        )
        if window < 0 or not 0 <= group < MAX_GROUPS or bs <= 0 or len(tokens) != n * bs:
            self.stats.skipped_events += 1
            return 0
        if ep.groups.windows.get(group) != window:
            self._learn_group(ep, group, window)
        if ep.block_size != bs:
            if ep.block_size is not None:
                logger.warning("block size changed %s -> %s: endpoint cleared", ep.block_size, bs)
                self._clear(ep)
            ep.block_size = bs
        if ev.parent_block_hash is None:
            parent = self._root
        else:
            parent = self._resolve(ep, ev.parent_block_hash)
            if parent is None and fallback is not None:
                parent = self._resolve(fallback, ev.parent_block_hash)
            if parent is None:
                self.stats.unresolved_parents += n
                return 0
        # Our keys for the event's blocks: the hash chain from the resolved parent.
        data = encode_tokens(tokens)
        stride = 4 * bs
        key_bytes: list[bytes] = []
        extra = ev.extra_keys
        if extra is None or not any(extra):
            sha = hashlib.sha256
            append = key_bytes.append
            for off in range(0, n * stride, stride):
                parent = sha(parent + data[off : off + stride]).digest()
                append(parent)
        else:
            for i in range(n):
                x = extra[i] if i < len(extra) else None
                parent = hash_block(parent, data[i * stride : (i + 1) * stride], x)
                key_bytes.append(parent)
        bit = medium_bit(ev.medium, ev.tier) << GROUP_SHIFT * group
        by_engine, by_key = ep.by_engine, ep.by_key
        holders, epbit = self._holders, ep.bit
        frm = int.from_bytes
        keys = [frm(kb[-8:], "big") for kb in key_bytes]
        # What a new entry holding only this event's copy is: indexed, below GPU only.
        if ep.groups.grouped:
            held, low = ep.groups.full_held(bit), ep.groups.full_lower(bit)
        else:  # one group of full attention, as before groups existed
            held, low = True, bit != 1
        if (
            by_engine.keys().isdisjoint(hashes)
            and by_key.keys().isdisjoint(keys)
            and len(set(hashes)) == n
        ):
            # All new (the common case): insert in bulk, at C speed.
            entries = list(map(_Entry, hashes, keys, key_bytes, repeat(bit)))
            by_engine.update(zip(hashes, entries, strict=True))
            by_key.update(zip(keys, entries, strict=True))
            if not held:  # a group that alone does not make a hit (sliding, one of several)
                pass
            elif holders.keys().isdisjoint(keys):
                holders.update(dict.fromkeys(keys, epbit))
            else:
                for key in keys:
                    holders[key] = holders.get(key, 0) | epbit
            if low:
                lower = self._lower
                for key in keys:
                    lower[key] = lower.get(key, 0) | epbit
            self.stats.blocks += n
            self.stats.stored_blocks += n
            self._bound(ep)
            return n
        added = 0
        for h, parent, key in zip(hashes, key_bytes, keys, strict=True):
            e = by_engine.get(h)
            if e is not None and by_key.get(e.key) is e:
                if e.key_bytes == parent:
                    self._add_copy(ep, e, bit)
                    by_key.move_to_end(e.key)
                    continue
                # The engine reused a hash for other content (restart without a clear).
                self._drop(ep, e)
            e = by_key.get(key)
            if e is not None:  # another engine hash of the same content: one more copy
                self._add_copy(ep, e, bit)
                by_engine[h] = e
                by_key.move_to_end(key)
                continue
            e = _Entry(h, key, parent, bit)
            by_engine[h] = e
            by_key[key] = e
            if held:
                holders[key] = holders.get(key, 0) | epbit
            if low:
                self._lower[key] = self._lower.get(key, 0) | epbit
            added += 1
        self.stats.blocks += added
        self.stats.stored_blocks += n
        self._bound(ep)
        return n

    def _learn_group(self, ep: _EndpointBlocks, group: int, window: int) -> None:
        """A group seen for the first time, or one whose kind or window changed (a new model
        behind the same address: what the endpoint held was another layout's)."""
        layout = ep.groups
        if group in layout.windows:
            logger.warning(
                "KV group %d changed window %s -> %s: endpoint cleared",
                group,
                layout.windows[group],
                window,
            )
            self._clear(ep)
            self.stats.layout_changes += 1
        if not layout.learn(group, window):
            return  # the same full-attention groups: the same entries count
        self._unindex(ep)
        for key, e in ep.by_key.items():
            if layout.full_held(e.mask):
                self._holders[key] = self._holders.get(key, 0) | ep.bit
            if layout.full_lower(e.mask):
                self._lower[key] = self._lower.get(key, 0) | ep.bit

    @staticmethod
    def _resolve(ep: _EndpointBlocks, engine_hash: int) -> bytes | None:
        """Our key bytes of ``ep``'s block ``engine_hash`` (held, or a recent ghost)."""
        pe = ep.by_engine.get(engine_hash)
        return pe.key_bytes if pe is not None else ep.ghosts.get(engine_hash)

    def _bound(self, ep: _EndpointBlocks) -> None:
        by_key = ep.by_key
        for _ in range(len(by_key) - self.max_blocks_per_endpoint):
            self._drop(ep, by_key[next(iter(by_key))])  # the least recently stored
            self.stats.evicted_blocks += 1

    def _add_copy(self, ep: _EndpointBlocks, e: _Entry, bit: int) -> None:
        old = e.mask
        e.add(bit)
        if e.mask != old:
            self._sync(ep, e.key, old, e.mask)

    def _sync(self, ep: _EndpointBlocks, key: int, old: int, new: int) -> None:
        """Keep the holder and lower-tier maps in step with a change of an entry's mask."""
        for table, was, now in (
            (self._holders, ep.groups.full_held(old), ep.groups.full_held(new)),
            (self._lower, ep.groups.full_lower(old), ep.groups.full_lower(new)),
        ):
            if now and not was:
                table[key] = table.get(key, 0) | ep.bit
            elif was and not now:
                m = table.get(key, 0) & ~ep.bit
                if m:
                    table[key] = m
                else:
                    table.pop(key, None)

    def _remove(self, ep: _EndpointBlocks, ev: BlockRemoved) -> int:
        if not 0 <= ev.group_idx < MAX_GROUPS:
            self.stats.skipped_events += 1
            return 0
        bit = medium_bit(ev.medium, ev.tier) << GROUP_SHIFT * ev.group_idx
        by_engine, by_key = ep.by_engine, ep.by_key
        for h in ev.block_hashes:
            e = by_engine.get(h)
            if e is None:
                self.stats.unknown_removals += 1
                continue
            if by_key.get(e.key) is not e:  # stale alias of an entry already gone
                del by_engine[h]
                self.stats.unknown_removals += 1
                continue
            old = e.mask
            if not e.remove(bit):
                self.stats.unknown_removals += 1
                continue
            if e.mask == 0:
                self._drop(ep, e)
                by_engine.pop(h, None)
            elif e.mask != old:  # e.g. now only on lower tiers, or out of a group
                self._sync(ep, e.key, old, e.mask)
        self.stats.removed_blocks += len(ev.block_hashes)
        return len(ev.block_hashes)

    def _drop(self, ep: _EndpointBlocks, e: _Entry) -> None:
        del ep.by_key[e.key]
        if ep.by_engine.get(e.engine_hash) is e:
            del ep.by_engine[e.engine_hash]
        key, bit = e.key, ep.bit
        m = self._holders.get(key, 0)
        if m & bit:  # (a hybrid endpoint's entry may not count there)
            m &= ~bit
            if m:
                self._holders[key] = m
            else:
                del self._holders[key]
        if key in self._lower:
            m = self._lower[key] & ~bit
            if m:
                self._lower[key] = m
            else:
                del self._lower[key]
        ep.ghosts[e.engine_hash] = e.key_bytes
        if len(ep.ghosts) > self.max_ghosts_per_endpoint:
            ep.ghosts.popitem(last=False)
        self.stats.blocks -= 1
