"""Scorers: each rates every candidate endpoint for a request in [0, 1] (higher = better).

Owns the scoring rules; the scheduler weights and sums them. A scorer may also
``observe`` where a request finally went (routing history, session table).

- ``precise_prefix``: the longest run of the prompt's blocks from block 0 that the endpoint
  holds according to its KV events, each block weighted by its best tier, over the prompt's
  cacheable blocks. A request's blocks also count as held, speculatively, by the endpoint it
  was just sent to, for ``speculative_ttl_s`` (2 s; 0: off): the window before that engine's
  BlockStored events arrive, in which a burst of requests sharing a new prefix would
  otherwise be spread by load and each compute the prefix again (llm-d's precise prefix cache
  scorer adds such speculative entries too). For a hybrid model (KV cache groups) the run is
  the index's hybrid hit: full-attention groups hold the prefix, sliding-window groups the
  window before its end (:mod:`kvserve.cluster.kv_index`).
- ``approx_prefix``: the same run length from the router's own routing history; by default
  only for endpoints that publish no KV events (so it never double counts with the above).
- ``queue_depth``: waiting requests, min-max normalized across candidates (fewest = 1).
- ``kv_cache_util``: 1 - KV-cache usage.
- ``load``: 1 - min(active requests, capacity) / capacity; active = max(scraped running +
  waiting, requests in flight through this router).
- ``session_affinity``: 1 for the endpoint that last served the request's session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvserve.cluster.endpoints import Endpoint
from kvserve.cluster.history import RoutingHistory, SessionTable
from kvserve.cluster.kv_index import KVIndex
from kvserve.cluster.routing_request import RoutingRequest


def clamp01(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


class Scorer(Protocol):
    name: str

    def score(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[float]: ...

    def observe(self, req: RoutingRequest, endpoint: Endpoint) -> None: ...


class _Stateless:
    def observe(self, req: RoutingRequest, endpoint: Endpoint) -> None:
        return None


class PrecisePrefixScorer:
    name = "precise_prefix"

    def __init__(
        self, index: KVIndex, default_block_size: int = 16, speculative_ttl_s: float = 2.0
    ) -> None:
        if speculative_ttl_s < 0:
            raise ValueError("speculative_ttl_s must be >= 0")
        self.index = index
        self.default_block_size = default_block_size
        # Blocks of requests just sent, per endpoint (expire after ttl..2*ttl).
        self.speculative = RoutingHistory(speculative_ttl_s) if speculative_ttl_s else None

    def _block_size(self, e: Endpoint) -> int:
        return self.index.endpoint_block_size(e.name) or self.default_block_size

    def score(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
        if req.token_ids is None:
            return [0.0] * len(endpoints)
        found = self.index.match_endpoints([e.name for e in endpoints], req.block_keys)
        spec = self.speculative
        held = req.held_tokens
        out = []
        for e in endpoints:
            n, weighted, total = found[e.name]
            if spec is not None and e.has_kv_events:
                keys = req.block_keys(self._block_size(e))
                extra = spec.match(e.name, keys) - n
                if extra > 0:  # on its way into the primary pool: full weight
                    weighted += extra
                    total = len(keys)
                    n += extra
            tokens = n * self._block_size(e) if n else 0
            if tokens >= held.get(e.name, 0):
                held[e.name] = tokens
            out.append(clamp01(weighted / total) if total else 0.0)
        return out

    def held_tokens(self, req: RoutingRequest, endpoint: Endpoint) -> int:
        """Prompt tokens ``endpoint`` holds (index and speculative entries), unweighted."""
        if req.token_ids is None:
            return 0
        bs = self._block_size(endpoint)
        keys = req.block_keys(bs)
        n = self.index.match(endpoint.name, keys)[0]
        if self.speculative is not None and endpoint.has_kv_events:
            n = max(n, self.speculative.match(endpoint.name, keys))
        return n * bs

    def observe(self, req: RoutingRequest, endpoint: Endpoint) -> None:
        if self.speculative is not None and endpoint.has_kv_events and req.token_ids is not None:
            self.speculative.record(endpoint.name, req.block_keys(self._block_size(endpoint)))


class ApproxPrefixScorer:
    name = "approx_prefix"

    def __init__(
        self, history: RoutingHistory, block_size: int, only_without_events: bool = True
    ) -> None:
        self.history = history
        self.block_size = block_size
        self.only_without_events = only_without_events

    def _applies(self, e: Endpoint) -> bool:
        return not (self.only_without_events and e.has_kv_events)

    def score(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
        if not any(self._applies(e) for e in endpoints):
            return [0.0] * len(endpoints)
        keys = req.history_keys(self.block_size)
        if not keys:
            return [0.0] * len(endpoints)
        n = len(keys)
        held = req.held_tokens
        out = []
        for e in endpoints:
            if not self._applies(e):
                out.append(0.0)
                continue
            m = self.history.match(e.name, keys)
            if m * self.block_size >= held.get(e.name, 0):
                held[e.name] = m * self.block_size
            out.append(clamp01(m / n))
        return out

    def held_tokens(self, req: RoutingRequest, endpoint: Endpoint) -> int:
        """Prompt tokens the history says ``endpoint`` holds (text: ~a block per chunk)."""
        if not self._applies(endpoint):
            return 0
        return self.history.match(endpoint.name, req.history_keys(self.block_size)) * (
            self.block_size
        )

    def observe(self, req: RoutingRequest, endpoint: Endpoint) -> None:
        if self._applies(endpoint):
            self.history.record(endpoint.name, req.history_keys(self.block_size))


class QueueDepthScorer(_Stateless):
    name = "queue_depth"

    def score(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
        q = [e.num_requests_waiting for e in endpoints]
        lo, hi = min(q), max(q)
        if hi <= lo:
            return [1.0] * len(endpoints)
        return [clamp01((hi - x) / (hi - lo)) for x in q]


class KVCacheUtilScorer(_Stateless):
    name = "kv_cache_util"

    def score(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
        return [clamp01(1.0 - e.kv_cache_usage_perc) for e in endpoints]


class LoadScorer(_Stateless):
    name = "load"

    def __init__(self, capacity: float = 32.0) -> None:
        if capacity <= 0:
            raise ValueError("load scorer capacity must be positive")
        self.capacity = float(capacity)

    def score(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
        cap = self.capacity
        return [clamp01(1.0 - min(e.active_requests, cap) / cap) for e in endpoints]


class SessionAffinityScorer:
    name = "session_affinity"

    def __init__(self, sessions: SessionTable) -> None:
        self.sessions = sessions

    def score(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[float]:
        owner = self.sessions.get(req.session_id) if req.session_id else None
        return [1.0 if e.name == owner else 0.0 for e in endpoints]

    def observe(self, req: RoutingRequest, endpoint: Endpoint) -> None:
        if req.session_id:
            self.sessions.put(req.session_id, endpoint.name)


class ScorerContext(Protocol):
    index: KVIndex
    history: RoutingHistory
    sessions: SessionTable
    history_block_size: int


SCORERS: dict[str, Callable[..., Scorer]] = {
    "precise_prefix": lambda ctx, **kw: PrecisePrefixScorer(
        ctx.index, ctx.history_block_size, **kw
    ),
    "approx_prefix": lambda ctx, **kw: ApproxPrefixScorer(
        ctx.history, ctx.history_block_size, **kw
    ),
    "queue_depth": lambda ctx, **kw: QueueDepthScorer(**kw),
    "kv_cache_util": lambda ctx, **kw: KVCacheUtilScorer(**kw),
    "load": lambda ctx, **kw: LoadScorer(**kw),
    "session_affinity": lambda ctx, **kw: SessionAffinityScorer(ctx.sessions, **kw),
}


def make_scorer(name: str, ctx: ScorerContext, params: dict | None = None) -> Scorer:
    try:
        factory = SCORERS[name]
    except KeyError:
        raise ValueError(f"unknown scorer {name!r}; known: {sorted(SCORERS)}") from None
    try:
        return factory(ctx, **(params or {}))
    except TypeError as e:
        raise ValueError(f"scorer {name!r}: bad parameters {params}: {e}") from None
