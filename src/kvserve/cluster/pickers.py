"""Pickers: turn combined scores into an ordered list of endpoints to try.

Owns the choice among scored candidates. The first endpoint is the pick; the rest are the
failover order (best score first). ``max_score`` breaks ties at random; ``weighted_random``
draws the pick with probability proportional to score; ``random`` and ``round_robin``
ignore scores (baselines). The pick is the only position where a tie-break matters, so only the
best's ties are drawn (one random number per decision, on every request's path).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Protocol


class Picker(Protocol):
    name: str

    def rank(self, scores: list[float]) -> list[int]:
        """Candidate indices, pick first."""
        ...


def _by_score(scores: list[float], rng: random.Random, exclude: int | None = None) -> list[int]:
    """Indices by score, best first; the pick is drawn at random among the best's ties."""
    order = [i for i in range(len(scores)) if i != exclude]
    order.sort(key=scores.__getitem__, reverse=True)  # stable: ties below stay in index order
    if len(order) > 1:
        best = scores[order[0]]
        ties = 1
        while ties < len(order) and scores[order[ties]] == best:
            ties += 1
        if ties > 1:
            j = rng.randrange(ties)
            order[0], order[j] = order[j], order[0]
    return order


class MaxScorePicker:
    name = "max_score"

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def rank(self, scores: list[float]) -> list[int]:
        return _by_score(scores, self.rng)


class WeightedRandomPicker:
    name = "weighted_random"

    def __init__(self, seed: int | None = None, temperature: float = 1.0) -> None:
        if temperature <= 0:
            raise ValueError("temperature must be positive")
        self.rng = random.Random(seed)
        self.temperature = temperature

    def rank(self, scores: list[float]) -> list[int]:
        if not scores:
            return []
        weights = [max(s, 0.0) ** (1.0 / self.temperature) for s in scores]
        if sum(weights) <= 0:
            first = self.rng.randrange(len(scores))
        else:
            first = self.rng.choices(range(len(scores)), weights=weights)[0]
        return [first, *_by_score(scores, self.rng, exclude=first)]


class RandomPicker:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def rank(self, scores: list[float]) -> list[int]:
        order = list(range(len(scores)))
        self.rng.shuffle(order)
        return order


class RoundRobinPicker:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, scores: list[float]) -> list[int]:
        n = len(scores)
        if n == 0:
            return []
        start = next(self._counter) % n
        return [(start + i) % n for i in range(n)]


PICKERS: dict[str, Callable[..., Picker]] = {
    "max_score": MaxScorePicker,
    "weighted_random": WeightedRandomPicker,
    "random": RandomPicker,
    "round_robin": RoundRobinPicker,
}


def make_picker(name: str, params: dict | None = None) -> Picker:
    try:
        cls = PICKERS[name]
    except KeyError:
        raise ValueError(f"unknown picker {name!r}; known: {sorted(PICKERS)}") from None
    try:
        return cls(**(params or {}))
    except TypeError as e:
        raise ValueError(f"picker {name!r}: bad parameters {params}: {e}") from None
