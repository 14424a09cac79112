"""Data-parallel servers behind the router: one endpoint per rank.

A server started with ``kvserve serve --data-parallel-size N`` (or vLLM's
``--data-parallel-size N`` with one API server per rank) has N separate KV caches: rank ``r``
listens on ``port + r`` and publishes its KV events on ``events_port + r`` (replay port
likewise), each batch carrying ``data_parallel_rank = r``. The router must index and route to
ranks, not to the server, so an endpoint declared with ``data_parallel_size: N`` becomes N
endpoints named ``NAME/dp{r}``, each with its own KV index entry, load and health.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from kvserve.cluster.config import EndpointSpec


def offset_address(address: str | None, rank: int) -> str | None:
    """``tcp://host:P`` -> ``tcp://host:P+rank`` (addresses without a port: unchanged)."""
    from kvserve.server.data_parallel import offset_endpoint

    return offset_endpoint(address, rank)


def offset_url(url: str, rank: int) -> str:
    parts = urlsplit(url)
    if parts.port is None:
        from kvserve.cluster.config import ConfigError

        raise ConfigError(f"endpoint {url}: data_parallel_size needs an explicit port")
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{host}:{parts.port + rank}"
    if parts.username:
        netloc = f"{parts.username}{':' + parts.password if parts.password else ''}@{netloc}"
    return urlunsplit(parts._replace(netloc=netloc))


def expand_data_parallel(endpoints: list[EndpointSpec]) -> list[EndpointSpec]:
    """Every endpoint with ``data_parallel_size`` N > 1 (and no rank yet) as N rank endpoints."""
    out: list[EndpointSpec] = []
    for e in endpoints:
        if e.data_parallel_size <= 1 or e.data_parallel_rank is not None:
            out.append(e)
            continue
        for r in range(e.data_parallel_size):
            out.append(
                dataclasses.replace(
                    e,
                    url=offset_url(e.url, r),
                    name=f"{e.key}/dp{r}",
                    kv_events=offset_address(e.kv_events, r),
                    kv_events_replay=offset_address(e.kv_events_replay, r),
                    data_parallel_rank=r,
                )
            )
    return out
