"""The router's Prometheus metrics (served at GET /metrics of `kvserve route`).

Owns metric names and the registry. Request-path metrics are counters and histograms
updated by the gateway through label children cached here (a ``labels()`` lookup formats and
hashes its label values under a lock: too slow for every request); state (endpoint health
and load, index size, event streams) is read at scrape time by a collector, so nothing on
the event path touches Prometheus objects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvserve.cluster.endpoints import EndpointPool
    from kvserve.cluster.event_subscriber import EventSubscriber
    from kvserve.cluster.kv_index import KVIndex
    from kvserve.cluster.upstream import UpstreamPool

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ROUTING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 1)


class _StateCollector(Collector):
    def __init__(self, state: Callable[[], tuple]) -> None:
        self._state = state

    def collect(self) -> Iterator:
        pool, index, subscriber, upstream = self._state()
        healthy = GaugeMetricFamily(
            "kvserve_router_endpoint_healthy", "1 if the endpoint is routable", labels=["endpoint"]
        )
        in_flight = GaugeMetricFamily(
            "kvserve_router_endpoint_in_flight",
            "Requests in flight through this router",
            labels=["endpoint"],
        )
        running = GaugeMetricFamily(
            "kvserve_router_endpoint_running", "Scraped running requests", labels=["endpoint"]
        )
        waiting = GaugeMetricFamily(
            "kvserve_router_endpoint_waiting", "Scraped waiting requests", labels=["endpoint"]
        )
        kv_usage = GaugeMetricFamily(
            "kvserve_router_endpoint_kv_cache_usage",
            "Scraped KV cache usage (0-1)",
            labels=["endpoint"],
        )
        blocks = GaugeMetricFamily(
            "kvserve_router_kv_index_endpoint_blocks",
            "Blocks indexed per endpoint",
            labels=["endpoint"],
        )
        connections = GaugeMetricFamily(
            "kvserve_router_endpoint_connections",
            "Connections to the endpoint in use or being opened (capped)",
            labels=["endpoint"],
        )
        queued = GaugeMetricFamily(
            "kvserve_router_endpoint_queued",
            "Requests waiting for a connection to the endpoint",
            labels=["endpoint"],
        )
        ejections = CounterMetricFamily(
            "kvserve_router_endpoint_ejections",
            "Times the endpoint was taken out of rotation",
            labels=["endpoint"],
        )
        prefill_in_flight = GaugeMetricFamily(
            "kvserve_router_endpoint_prefill_in_flight",
            "P/D prefill legs in flight through this router",
            labels=["endpoint"],
        )
        for ep in list(pool.endpoints.values()):
            prefill_in_flight.add_metric([ep.name], ep.prefill_in_flight)
            connections.add_metric([ep.name], upstream.busy(ep.origin))
            queued.add_metric([ep.name], upstream.queued(ep.origin))
            ejections.add_metric([ep.name], ep.ejections)
            healthy.add_metric([ep.name], 1.0 if ep.healthy else 0.0)
            in_flight.add_metric([ep.name], ep.in_flight)
            running.add_metric([ep.name], ep.num_requests_running)
            waiting.add_metric([ep.name], ep.num_requests_waiting)
            kv_usage.add_metric([ep.name], ep.kv_cache_usage_perc)
            blocks.add_metric([ep.name], index.endpoint_num_blocks(ep.name))
        yield from (healthy, in_flight, running, waiting, kv_usage, blocks)
        yield from (connections, queued, ejections, prefill_in_flight)
        yield GaugeMetricFamily(
            "kvserve_router_kv_index_blocks",
            "Entries (block x endpoint) in the KV index",
            value=index.num_blocks,
        )
        lag = GaugeMetricFamily(
            "kvserve_router_kv_event_lag_seconds",
            "Age of the last applied KV event batch when it was applied",
            labels=["endpoint"],
        )
        batches = CounterMetricFamily(
            "kvserve_router_kv_event_batches", "KV event batches applied", labels=["endpoint"]
        )
        block_events = CounterMetricFamily(
            "kvserve_router_kv_block_events",
            "Block store/remove events applied",
            labels=["endpoint"],
        )
        gaps = CounterMetricFamily(
            "kvserve_router_kv_event_gaps", "Sequence gaps seen", labels=["endpoint"]
        )
        missed = CounterMetricFamily(
            "kvserve_router_kv_event_missed_batches",
            "Batches lost (not replayable)",
            labels=["endpoint"],
        )
        for name, st in subscriber.all_stats().items():
            lag.add_metric([name], st.lag_s)
            batches.add_metric([name], st.batches)
            block_events.add_metric([name], st.block_events)
            gaps.add_metric([name], st.gaps)
            missed.add_metric([name], st.missed_batches)
        yield from (lag, batches, block_events, gaps, missed)


class LabelCache:
    """``metric.labels(*values)`` memoized: the request path's way to reach a child."""

    __slots__ = ("_metric", "_children")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple, Any] = {}

    def __call__(self, *values: Any) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*map(str, values))
        return child


class RouterMetrics:
    def __init__(
        self, state: Callable[[], tuple[EndpointPool, KVIndex, EventSubscriber, UpstreamPool]]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvserve_router_requests",
            "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "kvserve_router_request_seconds",
            "Upstream request time until the last byte",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_byte = Histogram(
            "kvserve_router_first_byte_seconds",
            "Upstream time until the response headers",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "kvserve_router_routing_decisions",
            "Routing decisions by reason",
            ["reason"],
            registry=r,
        )
        self.failovers = Counter(
            "kvserve_router_failovers",
            "Attempts that failed before the first byte",
            ["endpoint", "error"],
            registry=r,
        )
        self.rejected = Counter(
            "kvserve_router_rejected",
            "Requests answered by the router itself with an error",
            ["status"],
            registry=r,
        )
        self.routing_time = Histogram(
            "kvserve_router_routing_seconds",
            "Tokenize + hash + schedule time per request",
            buckets=_ROUTING_BUCKETS,
            registry=r,
        )
        self.pd_decisions = Counter(
            "kvserve_router_pd_decisions",
            "P/D decisions: split (disaggregated) or not, and why",
            ["disaggregated", "reason"],
            registry=r,
        )
        self.pd_fallbacks = Counter(
            "kvserve_router_pd_fallbacks",
            "Split requests whose prefill leg failed, served by the decode endpoint alone",
            ["error"],
            registry=r,
        )
        self.pd_prefill = Histogram(
            "kvserve_router_pd_prefill_seconds",
            "P/D prefill leg time (request sent to kv_transfer_params received)",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_StateCollector(state))
        # Cached children for the request path: requests_of(endpoint, status), ...
        self.requests_of = LabelCache(self.requests)
        self.latency_of = LabelCache(self.latency)
        self.first_byte_of = LabelCache(self.first_byte)
        self.decisions_of = LabelCache(self.decisions)
        self.failovers_of = LabelCache(self.failovers)
        self.rejected_of = LabelCache(self.rejected)
        self.pd_decisions_of = LabelCache(self.pd_decisions)
        self.pd_fallbacks_of = LabelCache(self.pd_fallbacks)
        self.pd_prefill_of = LabelCache(self.pd_prefill)
