"""Prometheus metrics of one server, with vLLM's names where the concept is the same.

Owns a per-app :class:`CollectorRegistry` (several servers may share a process in tests):
per-request histograms and counters updated by :class:`RequestTracker` as outputs stream
through the server, and engine gauges/counters read from the latest ``engine.get_stats()``
snapshot at scrape time. Counters are exposed with the ``_total`` suffix, as vLLM's are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.outputs import RequestMetrics, RequestOutput

# vLLM's buckets (seconds).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

# EngineStats field -> (metric name, kind, help).
_ENGINE_METRICS: dict[str, tuple[str, str, str]] = {
    "num_running": (
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
    ),
    "num_waiting": (
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
    ),
    "kv_cache_usage": (
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
    ),
    "prefix_cache_queries": (
        "vllm:prefix_cache_queries",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "prefix_cache_hits": (
        "vllm:prefix_cache_hits",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    "num_preemptions": (
        "vllm:num_preemptions",
        "counter",
        "Cumulative number of preemptions from the engine.",
    ),
}
# KVConnectorStats field -> (metric name, kind, help); exposed when the engine has a connector.
_CONNECTOR_METRICS: dict[str, tuple[str, str, str]] = {
    "lookup_query_tokens": (
        "vllm:external_prefix_cache_queries",
        "counter",
        "KV connector (offload tier) lookups, in terms of number of queried tokens.",
    ),
    "lookup_hit_tokens": (
        "vllm:external_prefix_cache_hits",
        "counter",
        "KV connector (offload tier) hits, in terms of number of cached tokens.",
    ),
    "lookups": ("kvserve:kv_offload_lookups", "counter", "KV connector lookups (requests)."),
    "load_bytes": (
        "vllm:kv_offload_load_bytes",
        "counter",
        "Bytes of KV loaded from offload tiers into the primary pool.",
    ),
    "load_time_s": (
        "vllm:kv_offload_load_time",
        "counter",
        "Seconds spent loading KV from offload tiers.",
    ),
    "store_bytes": (
        "vllm:kv_offload_store_bytes",
        "counter",
        "Bytes of KV stored from the primary pool into offload tiers.",
    ),
    "store_time_s": (
        "vllm:kv_offload_store_time",
        "counter",
        "Seconds spent storing KV into offload tiers.",
    ),
    "allocation_failures": (
        "kvserve:kv_offload_allocation_failures",
        "counter",
        "Offload stores skipped because a tier had no evictable space.",
    ),
}
# ``KVConnectorStats.extra`` keys ``usage_perc:<MEDIUM>`` are tier usages in [0, 1]; other
# extra keys are exposed as ``kvserve:kv_connector_stat{key=...}``.
_TIER_USAGE_PREFIX = "usage_perc:"
# ``KVConnectorStats.tiers``: per storage tier, TierStats counters and these gauges.
_TIER_GAUGES = {"usage_bytes", "capacity_bytes"}
_TIER_DOCS = {
    "hits": "Chunks read from the storage tier and verified.",
    "misses": "Chunks asked of the storage tier and not served (absent, corrupt or error).",
    "corrupt": "Chunks whose header or content hash did not verify (removed).",
    "errors": "I/O errors of the storage tier (the affected chunks were misses).",
    "read_bytes": "Bytes read from the storage tier.",
    "read_s": "Seconds spent reading from the storage tier.",
    "written": "Chunks written to the storage tier.",
    "write_bytes": "Bytes written to the storage tier.",
    "write_s": "Seconds spent writing to the storage tier.",
    "dropped": "Chunk writes dropped (queue full or over the watermark).",
    "evicted": "Chunks evicted by the storage tier.",
    "usage_bytes": "Bytes held by the storage tier.",
    "capacity_bytes": "Capacity of the storage tier in bytes (0: bounded by the server).",
}


def _family(name: str, kind: str, doc: str, labels: list[str]) -> Metric:
    cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
    return cls(name, doc, labels=labels)


class _EngineStatsCollector(Collector):
    """Exposes the engine's latest stats snapshot at scrape time."""

    def __init__(self, model_name: str, stats_fn: Callable[[], Any], has_connector: bool):
        self.model_name = model_name
        self.stats_fn = stats_fn
        self.has_connector = has_connector

    def collect(self) -> Iterator[Metric]:
        stats = self.stats_fn()
        if stats is None:
            return
        labels = [self.model_name]
        for attr, (name, kind, doc) in _ENGINE_METRICS.items():
            family = _family(name, kind, doc, ["model_name"])
            family.add_metric(labels, float(getattr(stats, attr)))
            yield family
        conn = getattr(stats, "connector", None)
        if not self.has_connector or conn is None:
            return
        for attr, (name, kind, doc) in _CONNECTOR_METRICS.items():
            family = _family(name, kind, doc, ["model_name"])
            family.add_metric(labels, float(getattr(conn, attr)))
            yield family
        tiers = _family(
            "kvserve:kv_offload_usage_perc",
            "gauge",
            "Offload tier usage per medium. 1 means 100 percent usage.",
            ["model_name", "medium"],
        )
        extra = _family(
            "kvserve:kv_connector_stat", "gauge", "Connector-specific stats.", ["model_name", "key"]
        )
        for key, value in sorted((conn.extra or {}).items()):
            if key.startswith(_TIER_USAGE_PREFIX):
                tiers.add_metric([self.model_name, key[len(_TIER_USAGE_PREFIX) :]], float(value))
            else:
                extra.add_metric([self.model_name, key], float(value))
        yield tiers
        yield extra
        # Storage tiers below host memory, one label value per tier id.
        rows = getattr(conn, "tiers", None) or {}
        keys = sorted({k for row in rows.values() for k in row})
        for key in keys:
            family = _family(
                f"kvserve:kv_tier_{key}",  # counters are exposed with a _total suffix
                "gauge" if key in _TIER_GAUGES else "counter",
                _TIER_DOCS.get(key, f"Storage tier {key.replace('_', ' ')}."),
                ["model_name", "tier"],
            )
            for tier_id, row in sorted(rows.items()):
                if key in row:
                    family.add_metric([self.model_name, tier_id], float(row[key]))
            yield family


class ServerMetrics:
    """All metrics of one server. ``registry`` is what /metrics renders."""

    def __init__(
        self, model_name: str, stats_fn: Callable[[], Any], has_connector: bool = False
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(model_name)
        self._request_success = Counter(
            "vllm:request_success",
            "Count of finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(model_name, reason)
        # kvserve's own: requests refused before the engine saw them, by HTTP status (4xx,
        # 429 when the queue is full, 503).
        self._request_rejected = Counter(
            "kvserve:request_rejected",
            "Count of API requests refused before reaching the engine, by HTTP status.",
            ["model_name", "status"],
            registry=r,
        )
        r.register(_EngineStatsCollector(model_name, stats_fn, has_connector))

    def request_success(self, finished_reason: str) -> None:
        self._request_success.labels(self.model_name, finished_reason).inc()

    def request_rejected(self, status: int) -> None:
        self._request_rejected.labels(self.model_name, str(status)).inc()

    def track(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Turns one request's cumulative outputs into metric observations (asyncio thread).

    Timings come from the engine's :class:`RequestMetrics` stamps, so they measure the engine,
    not when the server got around to reading the output.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.created = time.monotonic()
        self.num_tokens = 0
        self.last_token_time: float | None = None
        self.last_metrics: RequestMetrics | None = None
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        if self.done:
            return
        rm = out.metrics
        self.last_metrics = rm
        num_tokens = len(out.outputs[0].token_ids) if out.outputs else 0
        new = num_tokens - self.num_tokens
        if new > 0:
            now = time.monotonic()
            token_time = rm.last_token_time or now
            if self.num_tokens == 0:
                first = rm.first_token_time or token_time
                self.m.ttft.observe(max(0.0, first - rm.arrival_time))
                self.m.prompt_tokens.inc(len(out.prompt_token_ids))
                self.m.request_prompt_tokens.observe(len(out.prompt_token_ids))
                prev, gaps = first, new - 1
            else:
                prev, gaps = self.last_token_time or token_time, new
            if gaps > 0:
                gap = max(0.0, token_time - prev) / gaps
                for _ in range(gaps):
                    self.m.itl.observe(gap)
            self.m.generation_tokens.inc(new)
            self.num_tokens = num_tokens
            self.last_token_time = token_time
        if out.finished:
            self.finish(out.outputs[0].finish_reason if out.outputs else None)

    def finish(self, finished_reason: str | None) -> None:
        """Record the end of the request (``None``: it ended without finishing: abort)."""
        if self.done:
            return
        self.done = True
        self.m.request_success(finished_reason or "abort")
        rm = self.last_metrics
        arrival = rm.arrival_time if rm is not None else self.created
        end = rm.finished_time if rm is not None and rm.finished_time else time.monotonic()
        self.m.e2e.observe(max(0.0, end - arrival))
        self.m.request_generation_tokens.observe(self.num_tokens)
