"""What the router itself remembers about past routing: prefixes sent where, sessions pinned.

Owns two small LRU tables with a TTL: the routing history (block key -> endpoint, per
endpoint, for the approximate prefix scorer, which works without KV events) and the session
table (session id -> endpoint, for session affinity). Both only see this router's
decisions; neither knows what an engine evicted.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from itertools import takewhile


class RoutingHistory:
    """Per endpoint: keys of the prompt blocks recently routed there (oldest first)."""

    def __init__(self, ttl_s: float = 600.0, max_blocks_per_endpoint: int = 1_000_000) -> None:
        self.ttl_s = ttl_s
        self.max_blocks_per_endpoint = max_blocks_per_endpoint
        self._by_endpoint: dict[str, OrderedDict[int, float]] = {}
        self._lock = threading.Lock()

    def record(self, endpoint: str, keys: Sequence[int], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            table = self._by_endpoint.get(endpoint)
            if table is None:
                table = self._by_endpoint[endpoint] = OrderedDict()
            for k in keys:
                table[k] = now
                table.move_to_end(k)
            while len(table) > self.max_blocks_per_endpoint:
                table.popitem(last=False)
            self._expire(table, now)

    def match(self, endpoint: str, keys: Sequence[int], now: float | None = None) -> int:
        """Length of the run of ``keys`` from block 0 recently routed to ``endpoint``."""
        with self._lock:
            table = self._by_endpoint.get(endpoint)
            if not table:
                return 0
            self._expire(table, time.monotonic() if now is None else now)
            return sum(1 for _ in takewhile(table.__contains__, keys))

    def forget(self, endpoint: str) -> None:
        with self._lock:
            self._by_endpoint.pop(endpoint, None)

    def size(self) -> int:
        return sum(len(t) for t in list(self._by_endpoint.values()))

    def _expire(self, table: OrderedDict[int, float], now: float) -> None:
        cutoff = now - self.ttl_s
        while table:
            k = next(iter(table))
            if table[k] >= cutoff:
                break
            del table[k]


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
