"""What the router itself remembers about past routing: prefixes sent where, sessions pinned.

Owns two small tables with a TTL: the routing history (block keys -> endpoint, for the
approximate prefix scorer, which works without KV events) and the session table (session id
-> endpoint, for session affinity). Both only see this router's decisions; neither knows
what an engine evicted.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence


class _Generations:
    __slots__ = ("current", "previous", "started")

    def __init__(self, now: float) -> None:
        self.current: set[int] = set()
        self.previous: set[int] = set()
        self.started = now


class RoutingHistory:
    """Per endpoint: keys of the prompt blocks recently routed there.

    Kept as two generations of key sets per endpoint (a new one starts every ``ttl_s``, or
    when the current one would hold more than half of ``max_blocks_per_endpoint``; the one
    before the last is dropped whole), so recording a prompt is one C-level ``set.update``
    and a key is forgotten between ``ttl_s`` and ``2 * ttl_s`` after it was last routed.
    Keys are chained hashes recorded a whole prefix at a time and dropped a whole generation
    at a time, so if a prompt's block i is held, so are blocks 0..i-1: :meth:`match`
    binary-searches the run.
    """

    def __init__(self, ttl_s: float = 600.0, max_blocks_per_endpoint: int = 1_000_000) -> None:
        if ttl_s <= 0 or max_blocks_per_endpoint < 2:
            raise ValueError("ttl_s must be positive and max_blocks_per_endpoint >= 2")
        self.ttl_s = ttl_s
        self.max_blocks_per_endpoint = max_blocks_per_endpoint
        self._by_endpoint: dict[str, _Generations] = {}
        self._lock = threading.Lock()

    def record(self, endpoint: str, keys: Sequence[int], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            gens = self._by_endpoint.get(endpoint)
            if gens is None:
                gens = self._by_endpoint[endpoint] = _Generations(now)
            self._age(gens, now)
            if len(gens.current) + len(keys) > self.max_blocks_per_endpoint // 2:
                gens.previous, gens.current, gens.started = gens.current, set(), now
            gens.current.update(keys)

    def match(self, endpoint: str, keys: Sequence[int], now: float | None = None) -> int:
        """Length of the run of ``keys`` from block 0 recently routed to ``endpoint``."""
        with self._lock:
            gens = self._by_endpoint.get(endpoint)
            if gens is None:
                return 0
            self._age(gens, time.monotonic() if now is None else now)
            cur, prev = gens.current, gens.previous
            lo, hi = 0, len(keys)  # keys[:lo] are held; keys[hi:] are not
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                k = keys[mid - 1]
                if k in cur or k in prev:
                    lo = mid
                else:
                    hi = mid - 1
            return lo

    def forget(self, endpoint: str) -> None:
        with self._lock:
            self._by_endpoint.pop(endpoint, None)

    def size(self) -> int:
        """Keys held over all endpoints (a key in both generations counts twice)."""
        with self._lock:
            return sum(len(g.current) + len(g.previous) for g in self._by_endpoint.values())

    def _age(self, gens: _Generations, now: float) -> None:
        age = now - gens.started
        if age >= 2 * self.ttl_s:
            gens.previous, gens.current, gens.started = set(), set(), now
        elif age >= self.ttl_s:  # generations start on a grid of ttl_s: lifetimes stay bounded
            gens.previous, gens.current = gens.current, set()
            gens.started += self.ttl_s


class SessionTable:
    """Session id -> the endpoint that served it last."""

    def __init__(self, ttl_s: float = 3600.0, max_sessions: int = 1_000_000) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._table: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session_id: str, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        with self._lock:
            hit = self._table.get(session_id)
            if hit is None:
                return None
            if hit[1] < now - self.ttl_s:
                del self._table[session_id]
                return None
            return hit[0]

    def put(self, session_id: str, endpoint: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._table[session_id] = (endpoint, now)
            self._table.move_to_end(session_id)
            while len(self._table) > self.max_sessions:
                self._table.popitem(last=False)

    def forget_endpoint(self, endpoint: str) -> None:
        with self._lock:
            for sid in [s for s, (e, _) in self._table.items() if e == endpoint]:
                del self._table[sid]
