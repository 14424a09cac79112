"""Prefill/decode disaggregation: whether a request is split, and where its prefill runs.

Owns the per-request P/D decision (selective disaggregation, as llm-d's): the decode endpoint
is chosen first, by the scheduler's usual scorers among the endpoints that decode; then the
prompt tokens it does not hold yet decide (what the prefix scorers matched for it: the KV
index, speculative entries, the routing history). When they reach ``threshold`` and the
prefill pool has room, a prefill endpoint is chosen by the pool's own scorer profile among
the endpoints that prefill (never the decode endpoint itself), and the request is split: a
front end sends the prefill leg there, then the decode leg, carrying the prefill's
``kv_transfer_params``, to the decode endpoint. Otherwise the decode endpoint serves alone.

The decision is made inside :meth:`Scheduler.schedule`, so every front end gets it; front
ends only carry it out (the HTTP gateway: :mod:`kvserve.cluster.gateway`).

Reasons (metrics label, response header): ``uncached_above_threshold`` (split), else
``below_threshold``, ``prefill_saturated`` (every prefill endpoint has
``prefill_max_active`` prefill legs in flight or requests waiting), ``no_prefill_endpoint``
(none healthy that serves the model, other than the decode endpoint), or the request's own
reason not to split (:attr:`RoutingRequest.pd_skip`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvserve.cluster.config import PDConfig
from kvserve.cluster.endpoints import Endpoint
from kvserve.cluster.kv_index import KVIndex
from kvserve.cluster.routing_request import RoutingRequest

if TYPE_CHECKING:
    from kvserve.cluster.scheduler import Scheduler

REASON_SPLIT = "uncached_above_threshold"
REASON_BELOW = "below_threshold"
REASON_SATURATED = "prefill_saturated"
REASON_NO_PREFILL = "no_prefill_endpoint"
_BYTES_PER_TOKEN = 4  # an untokenized prompt's size in tokens, roughly


class HeldTokensSource(Protocol):
    """A prefix scorer that can say how many prompt tokens an endpoint holds."""

    def held_tokens(self, req: RoutingRequest, endpoint: Endpoint) -> int: ...


@dataclass
class PDDecision:
    disaggregate: bool
    reason: str
    uncached_tokens: int  # prompt tokens the decode endpoint does not hold (-1: not counted)
    prefill: Endpoint | None = None  # where the prefill leg goes, when split


class Disaggregator:
    def __init__(
        self,
        config: PDConfig,
        prefill_scheduler: Scheduler,
        sources: list[HeldTokensSource],
        index: KVIndex | None = None,
        default_block_size: int = 16,
    ) -> None:
        self.threshold = config.threshold
        self.max_active = config.prefill_max_active
        self.prefill_scheduler = prefill_scheduler
        self.sources = sources
        self.index = index
        self.default_block_size = default_block_size

    def decide(
        self, req: RoutingRequest, decode: Endpoint, endpoints: Iterable[Endpoint]
    ) -> PDDecision:
        if req.pd_skip:
            return PDDecision(False, req.pd_skip, -1)
        uncached = self.uncached_tokens(req, decode)
        if uncached < self.threshold:
            return PDDecision(False, REASON_BELOW, uncached)
        pool = [
            e
            for e in endpoints
            if e.healthy and e is not decode and e.spec.can_prefill and e.serves(req.model)
        ]
        if not pool:
            return PDDecision(False, REASON_NO_PREFILL, uncached)
        room = [e for e in pool if not self.saturated(e)]
        if not room:
            return PDDecision(False, REASON_SATURATED, uncached)
        ranked = self.prefill_scheduler.schedule(req, room).ranked
        return PDDecision(True, REASON_SPLIT, uncached, ranked[0])

    def saturated(self, e: Endpoint) -> bool:
        """No room for another prefill leg: ``prefill_max_active`` legs in flight from here,
        or as many requests waiting in the engine (scraped: other routers' legs too)."""
        return max(e.prefill_in_flight, e.num_requests_waiting) >= self.max_active

    def uncached_tokens(self, req: RoutingRequest, decode: Endpoint) -> int:
        """Prompt tokens ``decode`` would compute itself (the last one always is)."""
        if req.token_ids is not None:
            n = len(req.token_ids)
        else:  # no tokenizer: its length from the text; what is cached only from history
            n = len(req.text or b"") // _BYTES_PER_TOKEN
        held = req.held_tokens.get(decode.name)
        if held is None:  # not scored (a single candidate): ask the sources
            held = max((s.held_tokens(req, decode) for s in self.sources), default=0)
            if not self.sources and self.index is not None and req.token_ids is not None:
                bs = self.index.endpoint_block_size(decode.name) or self.default_block_size
                held = self.index.match(decode.name, req.block_keys(bs))[0] * bs
        return n - min(held, max(n - 1, 0))

    def observe(self, req: RoutingRequest, prefill: Endpoint) -> None:
        """The prefill leg went to ``prefill`` (its scorers' speculative entries, history)."""
        self.prefill_scheduler.observe(req, prefill)
