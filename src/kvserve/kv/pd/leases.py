"""Leases: the producer's blocks held for a decode engine to pull.

A finished prefill (``do_remote_decode``) keeps its full prompt blocks allocated under a lease
named by a random id. The lease ends, and the scheduler frees the blocks (``finished_sending``),
when a pull of it ends (whatever its outcome: a lease serves one pull), when nobody pulled it
within ``kv_lease_timeout`` seconds, or when the engine shuts down. A pull in progress is never
expired: its connection's own timeouts bound it.

The engine thread adds and expires leases; transport threads take and release them. Every
operation is under one lock; a release wakes the engine (``wakeup``) so a step waiting on
transfers notices it at once.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum

from kvserve.engine.hashing import BlockHash


class LeaseState(IntEnum):
    WAITING = 0  # held, not pulled yet
    PULLING = 1  # a pull took it
    RELEASED = 2


@dataclass(eq=False)
class Lease:
    lease_id: str
    req_id: str
    block_ids: list[int]  # the producer's blocks, in prompt order (full blocks only)
    block_hashes: list[BlockHash]
    deadline: float  # time.monotonic() after which a WAITING lease expires
    state: LeaseState = LeaseState.WAITING
    # xxh3-64 of each block, taken right after the lease was created ("sealed"): a pull sends
    # these, so a block changed after the prefill (or in transit) fails verification.
    digests: list[int] | None = None
    sealed: threading.Event = field(default_factory=threading.Event)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class LeaseCounts:
    created: int = 0
    pulled: int = 0  # released after a pull (successful or not)
    expired: int = 0
    dropped: int = 0  # released at shutdown


class LeaseTable:
    """Leases by id; thread-safe."""

    def __init__(self, timeout: float, wakeup: threading.Event | None = None) -> None:
        self.timeout = timeout
        self.wakeup = wakeup if wakeup is not None else threading.Event()
        self.counts = LeaseCounts()
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._order: deque[Lease] = deque()  # creation order = deadline order
        self._released: list[str] = []  # request ids whose blocks may be freed

    def add(self, req_id: str, block_ids: list[int], block_hashes: list[BlockHash]) -> Lease:
        lease = Lease(
            secrets.token_hex(16),
            req_id,
            list(block_ids),
            list(block_hashes),
            time.monotonic() + self.timeout,
        )
        with self._lock:
            self._leases[lease.lease_id] = lease
            self._order.append(lease)
            self.counts.created += 1
        return lease

    def take(self, lease_id: str) -> Lease | None:
        """The lease for a pull (WAITING -> PULLING), or None if unknown, taken or ended."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.state != LeaseState.WAITING:
                return None
            if time.monotonic() > lease.deadline:
                self._release_locked(lease)
                self.counts.expired += 1
                return None
            lease.state = LeaseState.PULLING
            return lease

    def release(self, lease: Lease) -> None:
        """End a lease after its pull (idempotent)."""
        with self._lock:
            if lease.state != LeaseState.RELEASED:
                self._release_locked(lease)
                self.counts.pulled += 1

    def _release_locked(self, lease: Lease) -> None:
        lease.state = LeaseState.RELEASED
        self._leases.pop(lease.lease_id, None)
        self._released.append(lease.req_id)
        self.wakeup.set()

    def expire(self, now: float | None = None) -> int:
        """Release WAITING leases past their deadline (engine thread); returns how many."""
        now = time.monotonic() if now is None else now
        n = 0
        with self._lock:
            order = self._order
            # A taken lease leaves the order: it ends with its pull, never by expiry.
            while order and (order[0].state != LeaseState.WAITING or order[0].deadline < now):
                lease = order.popleft()
                if lease.state == LeaseState.WAITING:
                    self._release_locked(lease)
                    self.counts.expired += 1
                    n += 1
        return n

    def take_released(self) -> list[str]:
        """Request ids of leases ended since the last call (their blocks may be freed)."""
        with self._lock:
            out, self._released = self._released, []
        return out

    def release_all(self) -> None:
        with self._lock:
            for lease in list(self._leases.values()):
                self._release_locked(lease)
                self.counts.dropped += 1
            self._order.clear()

    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    @property
    def num_active(self) -> int:
        return len(self._leases)

    def num_blocks_held(self) -> int:
        with self._lock:
            return sum(lease.num_blocks for lease in self._leases.values())

    def has_active(self) -> bool:
        return bool(self._leases)
