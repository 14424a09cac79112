"""KV cache specs and groups: which layers keep which KV, and how they share one block pool.

Owns the attention-type description of each layer's KV (:class:`FullAttentionSpec`: every
token; :class:`SlidingWindowSpec`: only the last ``window`` tokens are ever read) and the
grouping of layers into KV cache groups (:class:`KVCacheGroupSpec`). Every group has its own
block tables and prefix-cache entries in one shared :class:`~kvserve.engine.block_pool.BlockPool`;
a block holds ``layers_per_group`` layers, so every group has the same page size and one
tensor ``[num_blocks, layers_per_group, 2, block_size, H_kv, D]`` serves them all (a layer
reads slot ``kv_slot`` of its group's blocks).

Grouping (vLLM's hybrid KV cache rule): layers of one attention type are cut into groups of
``layers_per_group`` layers, the smallest type's layer count (or the largest when all are
within 1.25x of each other, so few slots stay empty); a type whose count is not a multiple
leaves empty slots in its last group. Full-attention groups come first, then sliding ones.
A pure full-attention model is one group of all layers (the layout and speed of a model
without groups); a model sliding in every layer is one sliding group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig


# Names of the attention types in KV events (vLLM's kv_cache_spec_kind); the router reads them.
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding-window group must hold before a block-aligned hit point: the token at
    position p attends to the ``window - 1`` tokens before it (as in transformers; vLLM's
    sliding-window manager asks for ``cdiv(window - 1, block_size)`` blocks). Equal to the
    hit's blocks minus :meth:`SlidingWindowSpec.num_skipped_blocks` at the hit."""
    return cdiv(window - 1, block_size) if window > 1 else 0


@dataclass(frozen=True)
class FullAttentionSpec:
    """Keys of every earlier token are read: every block is kept."""

    kind: str = FULL_ATTENTION

    @property
    def sliding_window(self) -> int | None:
        return None

    def num_skipped_blocks(self, num_computed_tokens: int, block_size: int) -> int:
        """Leading blocks no query after ``num_computed_tokens`` tokens reads: none."""
        return 0

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once."""
        return cdiv(num_tokens, block_size)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A query at position p reads keys (p - window, p]: blocks wholly before the window of
    the next query are never read again."""

    window: int
    kind: str = SLIDING_WINDOW

    @property
    def sliding_window(self) -> int | None:
        return self.window

    def num_skipped_blocks(self, num_computed_tokens: int, block_size: int) -> int:
        """Leading blocks wholly before ``num_computed_tokens - window + 1``, the oldest key
        of the next query (at position ``num_computed_tokens``)."""
        return max(0, num_computed_tokens - self.window + 1) // block_size

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks one request holds at once: the window before a prefill chunk of up to
        ``chunk`` tokens plus that chunk (a decode: ``cdiv(window - 1, bs) + 1``)."""
        return min(cdiv(num_tokens, block_size), cdiv(self.window - 1 + chunk, block_size) + 1)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers whose KV share block tables (same spec); layer ``layer_ids[i]`` uses slot i."""

    layer_ids: tuple[int, ...]
    spec: KVCacheSpec


def layer_spec(config: ModelConfig, layer_idx: int) -> KVCacheSpec:
    window = config.layer_window(layer_idx)
    return FullAttentionSpec() if window is None else SlidingWindowSpec(window)


def make_kv_cache_groups(config: ModelConfig, enable: bool = True) -> list[KVCacheGroupSpec]:
    """The model's KV cache groups. ``enable=False``: one full-attention group of every layer
    (every layer's KV for every token, as without groups); a single attention type: one group
    of every layer with that spec (a window in every layer: one sliding group)."""
    n = config.num_hidden_layers
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i in range(n):
        by_spec.setdefault(layer_spec(config, i), []).append(i)
    if not enable:
        return [KVCacheGroupSpec(tuple(range(n)), FullAttentionSpec())]
    if len(by_spec) == 1:
        return [KVCacheGroupSpec(tuple(range(n)), next(iter(by_spec)))]
    counts = [len(v) for v in by_spec.values()]
    size = min(counts)
    if max(counts) < 1.25 * size:
        size = max(counts)
    order = sorted(by_spec, key=lambda s: (s.kind != FULL_ATTENTION, by_spec[s][0]))
    groups: list[KVCacheGroupSpec] = []
    for spec in order:
        layers = by_spec[spec]
        for i in range(0, len(layers), size):
            groups.append(KVCacheGroupSpec(tuple(layers[i : i + size]), spec))
    return groups


def layers_per_group(groups: list[KVCacheGroupSpec]) -> int:
    """Layer slots of one block (the largest group)."""
    return max(len(g.layer_ids) for g in groups)


def layer_slots(groups: list[KVCacheGroupSpec]) -> dict[int, tuple[int, int]]:
    """``layer -> (group index, slot in the group's blocks)``."""
    return {layer: (g, s) for g, grp in enumerate(groups) for s, layer in enumerate(grp.layer_ids)}
