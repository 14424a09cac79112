"""Adaptive replacement cache (Megiddo & Modha): recency vs frequency, tuned by ghost hits.

- ``t1``: keys used once since they were stored; ``t2``: keys used at least twice.
- ``b1`` / ``b2``: ghosts (keys only) recently evicted from ``t1`` / ``t2``.
- ``target``: the size ``t1`` should have. Storing a key again that is a ghost in ``b1`` means
  ``t1`` was too small: the target grows; a ghost hit in ``b2`` shrinks it.
Eviction takes the least recent evictable key of ``t1`` while ``t1`` exceeds the target, of
``t2`` otherwise, falling back to the other list when the preferred one has nothing evictable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvserve.kv.offload.policies import EvictionPolicy, Key


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self.target = 0.0

    def insert(self, key: Key) -> None:
        if key in self.b1:
            self.target = min(
                float(self.capacity), self.target + max(1.0, len(self.b2) / len(self.b1))
            )
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.target = max(0.0, self.target - max(1.0, len(self.b1) / len(self.b2)))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def choose_victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        first, second = (self.t1, self.t2) if len(self.t1) > self.target else (self.t2, self.t1)
        for lst in (first, second):
            for key in lst:
                if evictable(key):
                    return key
        return None

    def evict(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            (self.b2 or self.b1).popitem(last=False)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: Key) -> bool:
        return key in self.t1 or key in self.t2
