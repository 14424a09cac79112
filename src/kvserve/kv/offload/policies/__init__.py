"""Eviction policies of an offload tier, selected by name (``lru``, ``arc``).

A policy orders the keys a tier holds (only completely stored ones) and picks victims. It
never sees slots or data, and it does not decide what may be evicted: the manager passes a
predicate (pinned or protected keys are skipped) and the policy returns its best candidate
among the keys that pass, or None.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable

Key = Hashable


class EvictionPolicy(ABC):
    """Order of the keys held by one tier of ``capacity`` chunks."""

    name: str

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Key) -> None:
        """``key`` was just stored (it was not held)."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """``key`` (held) was used again."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """``key`` is dropped for a reason other than eviction (e.g. found invalid)."""

    @abstractmethod
    def choose_victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        """The key to evict next among those passing ``evictable`` (not yet removed)."""

    @abstractmethod
    def evict(self, key: Key) -> None:
        """``key`` (returned by :meth:`choose_victim`) is evicted."""

    def insert_many(self, keys: Iterable[Key]) -> None:
        """:meth:`insert` of each of ``keys``, in order (one call for a step's stores)."""
        for key in keys:
            self.insert(key)

    def evict_many(self, n: int, evictable: Callable[[Key], bool]) -> list[Key]:
        """Choose and evict up to ``n`` keys passing ``evictable``, best victims first."""
        victims: list[Key] = []
        while len(victims) < n:
            key = self.choose_victim(evictable)
            if key is None:
                break
            self.evict(key)
            victims.append(key)
        return victims

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: Key) -> bool: ...


def create_policy(name: str, capacity: int) -> EvictionPolicy:
    from kvserve.kv.offload.policies.arc import ARCPolicy
    from kvserve.kv.offload.policies.lru import LRUPolicy

    policies: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}
    if name not in policies:
        raise ValueError(f"unknown kv_offload_policy {name!r}; choose from {sorted(policies)}")
    return policies[name](capacity)
