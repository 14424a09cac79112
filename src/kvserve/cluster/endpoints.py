"""The endpoints behind the router: who they are, whether they are up, how loaded they are.

Owns endpoint state and its upkeep: the list (static, plus the discovery sources of
:mod:`~kvserve.cluster.discovery`: an endpoints file, DNS of a headless Service), active
health checks (GET /health; out after ``unhealthy_after`` failures or at once
when the gateway finds its connection refused, back after one good check; a check that times
out while the endpoint answered proxied requests does not count: the router was slow, not the
endpoint; other failures of proxied requests only ask for a check now, :meth:`probe_soon`),
model discovery (GET /v1/models, with each model's ``max_model_len``) and load metrics scraped
from GET /metrics in Prometheus text format (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``). Checks, discovery and scrapes
carry the endpoint's bearer key, and run on connections of their own: a check never waits
behind the requests queued for the endpoint's connections.
Listeners hear about endpoints added and removed (the event subscriber, the index).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from kvserve.cluster.config import EndpointSpec, HealthConfig, RouterConfig
from kvserve.cluster.discovery import DnsSource, EndpointSource, FileSource
from kvserve.cluster.upstream import Origin, UpstreamError, UpstreamPool

logger = logging.getLogger(__name__)

METRIC_RUNNING = "vllm:num_requests_running"
METRIC_WAITING = "vllm:num_requests_waiting"
METRIC_KV_USAGE = "vllm:kv_cache_usage_perc"
_SCRAPED = (METRIC_RUNNING, METRIC_WAITING, METRIC_KV_USAGE)


@dataclass
class Endpoint:
    """Live state of one endpoint."""

    spec: EndpointSpec
    models: tuple[str, ...] = ()  # configured, else discovered
    model_cards: list[dict] = field(default_factory=list)  # /v1/models entries
    healthy: bool = False
    failures: int = 0  # consecutive failed health checks
    last_error: str | None = None
    num_requests_running: float = 0.0
    num_requests_waiting: float = 0.0
    kv_cache_usage_perc: float = 0.0
    metrics_at: float = 0.0  # time.monotonic() of the last successful scrape
    in_flight: int = 0  # requests this router has sent and not yet finished
    prefill_in_flight: int = 0  # of which P/D prefill legs
    answered_at: float = 0.0  # time.monotonic() of the last proxied response it answered
    max_model_len: int | None = None  # the largest context its model cards report
    ejections: int = 0  # times taken out of rotation
    # `Authorization` header for requests to it (its key, else the pool's upstream key)
    auth_header: tuple[bytes, bytes] | None = field(default=None, repr=False)
    name: str = field(init=False)  # the spec's key (a plain attribute: read per request)
    origin: Origin = field(init=False)  # where to connect, parsed once from the URL

    def __post_init__(self) -> None:
        self.name = self.spec.key
        self.origin = Origin.from_url(self.spec.url)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def has_kv_events(self) -> bool:
        return bool(self.spec.kv_events)

    @property
    def active_requests(self) -> float:
        """Best current estimate of requests on the endpoint (scraped or seen here)."""
        return max(self.num_requests_running + self.num_requests_waiting, float(self.in_flight))

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.models


def parse_prometheus_text(text: str, names: Iterable[str] = _SCRAPED) -> dict[str, float]:
    """Sum of the samples of each wanted metric (over label sets) in Prometheus text."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        if 0 <= brace < space:
            metric = line[:brace]
            close = line.rfind("}")
            rest = line[close + 1 :].split()
        else:
            metric = line[:space]
            rest = line[space + 1 :].split()
        if metric not in wanted or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        out[metric] = out.get(metric, 0.0) + value
    return out


Listener = Callable[[Endpoint], None]


class EndpointPool:
    """The set of endpoints and the background tasks that keep their state current."""

    def __init__(
        self,
        specs: Iterable[EndpointSpec] = (),
        *,
        health: HealthConfig | None = None,
        endpoints_file: str | None = None,
        file_poll_s: float = 1.0,
        upstream_api_key: str | None = None,
        dns: Iterable[str] = (),
        dns_poll_s: float = 5.0,
        sources: Iterable[EndpointSource] = (),
        sync_timeout_s: float = 10.0,
    ) -> None:
        self.health = health or HealthConfig()
        self.upstream_api_key = upstream_api_key
        self.endpoints_file = endpoints_file
        self.endpoints: dict[str, Endpoint] = {}
        self.on_added: list[Listener] = []
        self.on_removed: list[Listener] = []
        self.on_health_change: list[Listener] = []
        self._static = list(specs)
        # Discovery: each source's latest answer, merged after the static list.
        self.sources: list[EndpointSource] = []
        if endpoints_file:
            self.sources.append(FileSource(endpoints_file, file_poll_s))
        self.sources += [DnsSource(t, dns_poll_s) for t in dns]
        self.sources += list(sources)
        self._discovered: dict[int, list[EndpointSpec]] = {}  # id(source) -> its endpoints
        self.sync_timeout_s = sync_timeout_s  # start() waits this long for first DNS answers
        self._tasks: list[asyncio.Task] = []
        self._client: UpstreamPool | None = None
        self._own_client = False
        self._checking: set[str] = set()
        self._probes: set[asyncio.Task] = set()

    @classmethod
    def from_config(cls, config: RouterConfig) -> EndpointPool:
        """The pool of a router configuration (static endpoints, file, DNS targets)."""
        return cls(
            config.endpoints,
            health=config.health,
            endpoints_file=config.endpoints_file,
            file_poll_s=config.endpoints_file_poll_s,
            upstream_api_key=config.upstream_api_key,
            dns=config.endpoints_dns,
            dns_poll_s=config.endpoints_dns_poll_s,
        )

    @property
    def synced(self) -> bool:
        """Every discovery source has answered at least once (an empty answer counts)."""
        return all(s.answered for s in self.sources)

    # ------------------------------------------------------------------ membership

    def healthy(self) -> list[Endpoint]:
        return [e for e in self.endpoints.values() if e.healthy]

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for e in self.endpoints.values():
            if e.healthy:
                seen.update(dict.fromkeys(e.models))
        return list(seen)

    def set_specs(self, specs: Iterable[EndpointSpec]) -> None:
        """Make the pool hold exactly ``specs`` (by name); changed specs are replaced."""
        wanted = {s.key: s for s in specs}
        for name in list(self.endpoints):
            if name not in wanted or wanted[name] != self.endpoints[name].spec:
                ep = self.endpoints.pop(name)
                logger.info("endpoint removed: %s", name)
                for cb in self.on_removed:
                    cb(ep)
        for name, spec in wanted.items():
            if name not in self.endpoints:
                ep = Endpoint(spec, models=(spec.model,) if spec.model else ())
                key = spec.api_key or self.upstream_api_key
                if key:
                    ep.auth_header = (b"authorization", b"Bearer " + key.encode("latin-1"))
                self.endpoints[name] = ep
                logger.info("endpoint added: %s", name)
                for cb in self.on_added:
                    cb(ep)

    def load(self) -> None:
        """Apply the static list plus the endpoints files (read now: raises ConfigError on a
        missing or bad one) and the other sources' latest answers."""
        for source in self.sources:
            if isinstance(source, FileSource):
                self._discovered[id(source)] = source.read()
        self._apply()

    def _apply(self) -> None:
        """The static list, then each source's endpoints (the first of a name wins)."""
        specs: dict[str, EndpointSpec] = {}
        for spec in self._static + [
            s for src in self.sources for s in self._discovered.get(id(src), [])
        ]:
            specs.setdefault(spec.key, spec)
        self.set_specs(specs.values())

    async def refresh(self, source: EndpointSource) -> bool:
        """Poll one source and apply a new answer; True when it had one."""
        specs = await source.poll()
        if specs is None:
            return False
        self._discovered[id(source)] = specs
        self._apply()
        # Newly added endpoints are checked now, not at the next round.
        await asyncio.gather(
            *(self.check(e) for e in self.endpoints.values() if not e.healthy and e.failures == 0)
        )
        return True

    # ------------------------------------------------------------------ upkeep

    async def start(self, client: UpstreamPool | None = None) -> None:
        """Load, check every endpoint once, then keep checking in the background.

        ``client``: the connections for checks, discovery and scrapes (not the request
        traffic's: a check must not wait for a connection behind requests)."""
        self._client = client or UpstreamPool(max_idle_per_origin=2)
        self._own_client = client is None
        self.load()
        # First answers of the other sources (DNS) before the first checks: a resolver that
        # fails (not yet reachable as a pod starts) is asked again for up to sync_timeout_s.
        deadline = time.monotonic() + self.sync_timeout_s
        for source in self.sources:
            if isinstance(source, FileSource):
                continue
            while True:
                specs = await source.poll()
                if specs is not None or source.answered or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(min(source.poll_s, 0.5))
            self._discovered[id(source)] = specs or []
        self._apply()
        await asyncio.gather(*(self.check(e) for e in list(self.endpoints.values())))
        await asyncio.gather(*(self.scrape(e) for e in list(self.endpoints.values())))
        self._tasks = [
            asyncio.create_task(self._loop(self.health.interval_s, self._check_all)),
            asyncio.create_task(self._loop(self.health.metrics_interval_s, self._scrape_all)),
        ]
        for source in self.sources:
            refresh = functools.partial(self.refresh, source)
            self._tasks.append(asyncio.create_task(self._loop(source.poll_s, refresh)))

    async def stop(self) -> None:
        tasks = self._tasks + list(self._probes)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        self._probes.clear()
        if self._client is not None and self._own_client:
            await self._client.close()
        self._client = None

    async def _loop(self, interval: float, fn: Callable) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:  # keep the upkeep alive whatever one round does
                logger.exception("endpoint upkeep failed")

    async def _check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in list(self.endpoints.values())))

    async def _scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(e) for e in list(self.endpoints.values()) if e.healthy))

    async def _get(self, ep: Endpoint, path: str) -> tuple[int, bytes]:
        assert self._client is not None
        headers = [ep.auth_header] if ep.auth_header else None
        return await self._client.get(
            ep.origin, path, timeout_s=self.health.timeout_s, headers=headers
        )

    async def check(self, ep: Endpoint) -> bool:
        """One health check (and model discovery while the models are unknown)."""
        if ep.name in self._checking or self._client is None:
            return ep.healthy
        self._checking.add(ep.name)
        started = time.monotonic()
        try:
            status, _ = await self._get(ep, "/health")
            ok = status == 200
            if ok and (not ep.model_cards or not ep.models):
                await self._discover(ep)
            error = None if ok else f"/health returned {status}"
        except TimeoutError as e:
            ok, error = False, f"{type(e).__name__}: {e}"
            if ep.answered_at >= started:
                # It answered real requests meanwhile: the check was slow because this
                # process is overloaded (its event loop lags), not because the endpoint is.
                return ep.healthy
        except (UpstreamError, OSError) as e:
            ok, error = False, f"{type(e).__name__}: {e}"
        finally:
            self._checking.discard(ep.name)
        if ep.name not in self.endpoints or self.endpoints[ep.name] is not ep:
            return False  # removed meanwhile
        if ok and not ep.models:
            ok, error = False, "serves no model"
        if ok:
            ep.failures = 0
            ep.last_error = None
            self._set_health(ep, True)
        else:
            ep.failures += 1
            ep.last_error = error
            if ep.failures >= self.health.unhealthy_after:
                self._set_health(ep, False)
        return ep.healthy

    async def _discover(self, ep: Endpoint) -> None:
        try:
            status, raw = await self._get(ep, "/v1/models")
            if status != 200:
                return
            body = msgspec.json.decode(raw)
        except (TimeoutError, UpstreamError, OSError, msgspec.DecodeError):
            return
        if not isinstance(body, dict) or not isinstance(body.get("data"), list):
            return
        cards = [c for c in body.get("data", []) if isinstance(c, dict) and "id" in c]
        ep.model_cards = cards
        lens = [c.get("max_model_len") for c in cards]
        lens = [n for n in lens if type(n) is int and n > 0]
        ep.max_model_len = max(lens) if lens else None
        if not ep.spec.model:
            ep.models = tuple(str(c["id"]) for c in cards)

    async def scrape(self, ep: Endpoint) -> None:
        if self._client is None:
            return
        try:
            status, raw = await self._get(ep, "/metrics")
            if status != 200:
                return
            text = raw.decode("utf-8")
        except (TimeoutError, UpstreamError, OSError, UnicodeDecodeError):
            return
        values = parse_prometheus_text(text)
        ep.num_requests_running = values.get(METRIC_RUNNING, 0.0)
        ep.num_requests_waiting = values.get(METRIC_WAITING, 0.0)
        ep.kv_cache_usage_perc = min(max(values.get(METRIC_KV_USAGE, 0.0), 0.0), 1.0)
        ep.metrics_at = time.monotonic()

    def probe_soon(self, ep: Endpoint) -> None:
        """A proxied request failed in a way that may or may not mean ``ep`` is down (a
        dropped connection, a connect timeout): check it now rather than at the next round."""
        if ep.name in self._checking or self._client is None:
            return
        task = asyncio.get_running_loop().create_task(self.check(ep))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def mark_failed(self, ep: Endpoint, error: str) -> None:
        """``ep`` refused a connection: out now, back on the next good check."""
        ep.last_error = error
        ep.failures = max(ep.failures, self.health.unhealthy_after)
        self._set_health(ep, False)

    def _set_health(self, ep: Endpoint, healthy: bool) -> None:
        if ep.healthy != healthy:
            ep.healthy = healthy
            if healthy:
                logger.info("endpoint %s healthy", ep.name)
            else:
                ep.ejections += 1
                logger.warning("endpoint %s unhealthy: %s", ep.name, ep.last_error)
            for cb in self.on_health_change:
                cb(ep)
