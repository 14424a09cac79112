"""KV cache groups in the router's index: an endpoint's group layout and the hybrid hit rule.

Owns what the index knows of a hybrid model (Gemma 3, gpt-oss, Mistral-style sliding windows):
the layout of one endpoint's groups as its events declare them (group id -> sliding window in
tokens, 0 for full attention), how one entry's media mask holds every group (6 bits per group,
``medium_bit << GROUP_SHIFT * group``: a group costs no memory of its own), and the rule that
decides a hit (vLLM's, and the engine's, :mod:`kvserve.engine.single_type_managers`): a prefix
of L blocks is held when every full-attention group holds blocks [0, L) and every sliding
group the ``window_blocks`` blocks before L. Pure functions over masks; the index
(:mod:`kvserve.cluster.kv_index`) owns the maps they read.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from itertools import compress, repeat
from operator import attrgetter, or_
from typing import Any

from kvserve.engine.kv_cache_spec import FULL_ATTENTION, SLIDING_WINDOW, window_blocks

GROUP_SHIFT = 6  # group g's media bits are ``bit << GROUP_SHIFT * g`` in an entry's mask
MAX_GROUPS = 64
MEDIA_MASK = (1 << GROUP_SHIFT) - 1  # one group's media bits, shifted down
_PROBES_BEFORE_SKIP = 64  # window probes before the walk-down jumps between held blocks

_MASK = attrgetter("mask")


class _Nothing:
    mask = 0  # stands in for a block a map does not hold


_NOTHING = _Nothing()


def event_window(kind: str, window: int | None) -> int:
    """The layout value of a group from its event fields: 0 for full attention, the window
    for a sliding window, -1 for what the rule cannot score (another kind, no window)."""
    if kind == FULL_ATTENTION:
        return 0
    if kind == SLIDING_WINDOW and window is not None and window > 0:
        return window
    return -1


class GroupLayout:
    """The KV groups one endpoint (or shared tier) published, and what they make of a mask.

    ``grouped`` is False while the endpoint published only group 0 with full attention: then
    a mask is held when non-zero and below GPU when its GPU bit is clear, exactly as before
    groups existed.
    """

    __slots__ = ("windows", "grouped", "full_shifts", "sliding_bits")

    def __init__(self) -> None:
        self.windows: dict[int, int] = {}  # group id -> sliding window (0: full attention)
        self.grouped = False
        self.full_shifts: tuple[int, ...] = (0,)  # mask shifts of the full-attention groups
        self.sliding_bits = 0  # every media bit of every sliding group

    def learn(self, group: int, window: int) -> bool:
        """Record ``group``'s window; True when the full-attention groups changed (what
        makes an entry held changed: the index reindexes the endpoint)."""
        self.windows[group] = window
        self.grouped = self.windows != {0: 0}
        self.sliding_bits = sum(
            MEDIA_MASK << GROUP_SHIFT * g for g, win in self.windows.items() if win
        )
        full = tuple(GROUP_SHIFT * g for g, win in sorted(self.windows.items()) if not win)
        changed = full != self.full_shifts
        self.full_shifts = full
        return changed

    def sliding(self, block_size: int) -> list[tuple[int, int]]:
        """Sliding groups as (mask shift, blocks needed before a hit point)."""
        return [
            (GROUP_SHIFT * g, window_blocks(win, block_size))
            for g, win in self.windows.items()
            if win
        ]

    def full_held(self, mask: int) -> bool:
        """Does the entry count in the one pass from block 0: every full-attention group
        holds it (any group, for a model with sliding windows only)."""
        if not self.grouped or not self.full_shifts:
            return mask != 0
        return all((mask >> s) & MEDIA_MASK for s in self.full_shifts)

    def full_lower(self, mask: int) -> bool:
        """Held (:meth:`full_held`) but some full-attention group has it below GPU only."""
        if not self.grouped:
            return mask != 0 and not mask & 1
        if not self.full_held(mask):
            return False
        return any(not (mask >> s) & 1 for s in self.full_shifts)

    def full_cost(self, mask: int, w: Sequence[float]) -> float:
        """1 - the weight of a block for the full-attention groups: their worst tier."""
        if not self.grouped:
            return 1.0 - w[mask & MEDIA_MASK]
        return max((1.0 - w[(mask >> s) & MEDIA_MASK] for s in self.full_shifts), default=0.0)

    def full_costs(self, masks: Sequence[int], w: Sequence[float]) -> float:
        """Sum of :meth:`full_cost` over ``masks`` (one evaluation per distinct mask)."""
        cost_of = {m: self.full_cost(m, w) for m in set(masks)}
        return sum(map(cost_of.__getitem__, masks))


def masks_of(maps: Sequence[Mapping[int, Any]], keys: Sequence[int]) -> list[int]:
    """Masks of ``keys`` in ``maps`` (key -> entry with a ``mask``) ORed together, 0 where
    none holds it, at C speed: a block held partly by an endpoint, partly by a tier it can
    load from, is held by the groups of both, each on its best medium."""
    out = list(map(_MASK, map(maps[0].get, keys, repeat(_NOTHING))))
    for t in maps[1:]:
        out = list(map(or_, out, map(_MASK, map(t.get, keys, repeat(_NOTHING)))))
    return out


def full_run(layout: GroupLayout, maps: Sequence[Mapping[int, Any]], keys: Sequence[int]):
    """Masks of blocks [0, run) of ``keys``, run: the longest from block 0 that every
    full-attention group holds in ``maps``. Chunk by chunk: the work follows the run, not
    the prompt."""
    fulls = [MEDIA_MASK << s for s in layout.full_shifts]
    out: list[int] = []
    pos, step = 0, 64
    while pos < len(keys):
        chunk = masks_of(maps, keys[pos : pos + step])
        end = len(chunk)
        for fm in fulls:
            held = list(map(fm.__and__, chunk))
            if 0 in held:
                end = min(end, held.index(0))
        out += chunk[:end]
        if end < len(chunk):
            break
        pos, step = pos + step, min(2 * step, 1024)
    return out


def sliding_hit(
    sliding: list[tuple[int, int]],
    top: int,
    mask_at: Callable[[int], int],
    candidates: Callable[[], list[int]],
) -> int:
    """The largest hit L <= ``top`` whose sliding windows are all held (``sliding``: (mask
    shift, blocks needed) per group; ``mask_at(i)``: block i's mask).

    A block missing at j in a window rules out every L in (j, j + need], so L jumps to j.
    After a few jumps (a window lost over a long stretch) L jumps instead to the next of
    ``candidates()``: ascending positions < top where some sliding group may hold the block
    (every sliding group must hold block L - 1)."""
    hit = top
    probes = 0
    held: list[int] | None = None
    while hit > 0 and sliding:
        bound = hit
        for s, need in sliding:
            for j in range(hit - 1, max(0, hit - need) - 1, -1):
                probes += 1
                if not (mask_at(j) >> s) & MEDIA_MASK:
                    bound = min(bound, j)
                    break
        if bound == hit:
            break
        hit = bound
        if probes > _PROBES_BEFORE_SKIP and hit:
            if held is None:
                held = candidates()
            i = bisect_right(held, hit - 1)
            hit = held[i - 1] + 1 if i else 0
    return hit


def candidates_by_bits(bits: int, masks: Sequence[int]) -> list[int]:
    """Positions whose mask has any of ``bits`` (a layout's ``sliding_bits``), ascending."""
    return list(compress(range(len(masks)), map(bits.__and__, masks)))


def window_cost(
    layout: GroupLayout,
    w: Sequence[float],
    hit: int,
    sliding: list[tuple[int, int]],
    mask_at: Callable[[int], int],
) -> float:
    """Extra tier cost of the window blocks before ``hit``: a block costs the worst tier
    among the groups that need it, the full-attention groups' cost already counted."""
    extra = 0.0
    span = max((need for _, need in sliding), default=0)
    for i in range(max(0, hit - span), hit):
        m = mask_at(i)
        base = layout.full_cost(m, w)
        worst = base
        for s, need in sliding:
            if i >= hit - need:
                c = 1.0 - w[(m >> s) & MEDIA_MASK]
                if c > worst:
                    worst = c
        extra += worst - base
    return extra
