"""Least-recently-used eviction: one ordered dict, least recent first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvserve.kv.offload.policies import EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def insert_many(self, keys: Iterable[Key]) -> None:
        order = self._order
        for key in keys:
            order[key] = None
            order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def choose_victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        for key in self._order:
            if evictable(key):
                return key
        return None

    def evict(self, key: Key) -> None:
        del self._order[key]

    def evict_many(self, n: int, evictable: Callable[[Key], bool]) -> list[Key]:
        victims: list[Key] = []
        if n > 0:
            for key in self._order:  # one pass from the least recent
                if evictable(key):
                    victims.append(key)
                    if len(victims) == n:
                        break
        order = self._order
        for key in victims:
            del order[key]
        return victims

    def keys(self) -> list[Key]:
        """Held keys, least recently used first."""
        return list(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Key) -> bool:
        return key in self._order
