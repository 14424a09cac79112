"""Filters: drop endpoints that cannot take a request at all, before scoring.

Owns the hard constraints. When a filter leaves nothing, it says why with an HTTP status:
no endpoint serves the model (404) or none that does is healthy (503).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvserve.cluster.endpoints import Endpoint
from kvserve.cluster.routing_request import RoutingRequest


class NoEndpointError(Exception):
    """No endpoint can serve the request."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Filter(Protocol):
    name: str

    def apply(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[Endpoint]: ...


class ModelFilter:
    """Endpoints serving the requested model (any, when the request names none)."""

    name = "model"

    def apply(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        if req.model is None:
            return endpoints
        kept = [e for e in endpoints if req.model in e.models]
        if not kept and endpoints:
            if any(not e.models for e in endpoints):  # some never answered: maybe theirs
                raise NoEndpointError(503, f"no reachable endpoint serves `{req.model}`")
            raise NoEndpointError(404, f"The model `{req.model}` does not exist.")
        return kept


class HealthyFilter:
    name = "healthy"

    def apply(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        kept = [e for e in endpoints if e.healthy]
        if not kept:
            raise NoEndpointError(503, "no healthy endpoint can serve this request")
        return kept


class DecodeRoleFilter:
    """Endpoints that serve whole requests (role ``decode`` or ``both``): an endpoint of the
    prefill pool only takes prefill legs. Always applied, first."""

    name = "decode_role"

    def apply(self, req: RoutingRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        kept = [e for e in endpoints if e.spec.can_decode]
        if not kept and endpoints:
            raise NoEndpointError(503, "no decode endpoint (every endpoint has role prefill)")
        return kept


FILTERS: dict[str, Callable[[], Filter]] = {"model": ModelFilter, "healthy": HealthyFilter}


def make_filter(name: str) -> Filter:
    try:
        return FILTERS[name]()
    except KeyError:
        raise ValueError(f"unknown filter {name!r}; known: {sorted(FILTERS)}") from None
