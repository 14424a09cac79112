"""Configuration of `kvserve route`: the router's YAML schema as dataclasses, with defaults.

Owns the schema and its loading/validation (unknown keys are errors, so a typo never
silently falls back to a default). Example: ``examples/router.yaml``.

Defaults and why:
- scorers: ``precise_prefix`` 3 (KV events; longest cached run from block 0, tier-weighted,
  plus speculative entries for requests just sent, 2 s), ``load`` 1 (active requests,
  capped at 32), and ``approx_prefix`` 3 (routing history; only scores endpoints that
  publish no events, so the two never double count). Chosen with
  ``benchmarks/bench_routing_quality.py`` (2 real tiny-preset engines, each with a pool of
  60% of the working set; ``benchmarks/results/routing_quality.md``): against round robin,
  throughput 1.8x / 1.9x and TTFT p50 5.6x / 5.1x better (multi-turn chat / shared system
  prompts), where load alone gives 1.1x / 1.4x throughput. An earlier measurement (shorter
  prompts) rejected the previous defaults (load 2, ``queue_depth`` 1, ``kv_cache_util`` 1
  as well): they sent every system-prompt request to one engine, because the scraped terms
  (sampled every 0.5 s, tiny at this concurrency) never outweighed the prefix. Prefix
  outweighs load, as in llm-d (prefix 3, queue 2, kv-util 2): a full prefix hit (3) beats an
  idle endpoint; load breaks ties between equal hits and spreads cold prefixes.
  ``queue_depth``, ``kv_cache_util`` and ``session_affinity`` stay available at weight 0
  (affinity alone hot-spots).
- picker ``max_score`` (random tie-break); ``weighted_random`` spreads load more.
- health: checked every 1 s, out after 2 failed checks or at once on a refused connection,
  back after one good check; metrics scraped every 0.5 s.
- index: at most 2M blocks per endpoint (an LRU bound against lost removals; an entry costs
  about 290 bytes, measured: 1M blocks ~ 280 MiB), tier weights GPU 1.0, CPU 0.8, DISK 0.6,
  FS 0.5, REDIS 0.5.
- overload: at most 256 connections per endpoint (well inside an engine's accept backlog,
  uvicorn's is 2048), then a FIFO queue of 1,024 requests per endpoint waiting up to 60 s for
  one; beyond that 503 with ``Retry-After`` (``benchmarks/bench_router_overload.py``). An
  endpoint is taken out only on evidence: failed health checks or a refused connection,
  never a connect timeout (with a burst in an engine's backlog, that is our own load).
- clients: a request's head within 10 s, its body within 60 s of its head (else 408),
  kept-alive connections closed after 30 s idle; bodies up to 64 MiB.
- prefill/decode disaggregation (``pd``): off unless ``pd.threshold`` > 0. Endpoints have a
  ``role``: ``prefill``, ``decode`` or ``both`` (default). The decode endpoint is chosen
  first, by the scorers above, among ``decode``/``both`` endpoints; a request is split when
  the prompt tokens that endpoint does not hold reach ``threshold`` and some prefill endpoint
  (``prefill``/``both``, not the decode endpoint) is not saturated (fewer than
  ``prefill_max_active`` prefill legs in flight and waiting requests). The prefill endpoint
  is chosen by its own profile (``prefill_scorers``: prefix 3 + load 1 by default, as for
  decode: its cached prefix makes the prefill cheaper). A prefill leg has
  ``prefill_timeout_s`` (30 s) to answer; on failure the decode endpoint serves alone.
- authentication: off unless API keys are given (``api_keys``, ``--api-key``,
  ``KVSERVE_API_KEY`` / ``VLLM_API_KEY``); then ``/v1/*`` and ``/router/state`` need
  ``Authorization: Bearer <key>`` (``/metrics`` too with ``api_key_metrics``); ``/health``,
  ``/version`` and ``/openapi.json`` stay open. Requests to an endpoint carry its
  ``api_key``, else ``upstream_api_key``, else the client's own ``Authorization``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvserve.cluster.kv_index import DEFAULT_TIER_WEIGHTS
from kvserve.engine.hashing import DEFAULT_PREFIX_HASH_SEED


class ConfigError(ValueError):
    """A router configuration that cannot be used (the message names the key)."""


def _check_curve_key(path: str, *, secret: bool) -> None:
    from kvserve.kv.event_curve import CurveKeyError, load_key_pair, load_public_key

    try:
        if secret:
            load_key_pair(path)
        else:
            load_public_key(path)
    except CurveKeyError as e:
        raise ConfigError(str(e)) from None


ROLE_PREFILL, ROLE_DECODE, ROLE_BOTH = "prefill", "decode", "both"
_ROLE_ALIASES = {
    "prefill": ROLE_PREFILL, "producer": ROLE_PREFILL, "kv_producer": ROLE_PREFILL,
    "decode": ROLE_DECODE, "consumer": ROLE_DECODE, "kv_consumer": ROLE_DECODE,
    "both": ROLE_BOTH, "kv_both": ROLE_BOTH,
}  # fmt: skip


@dataclass
class EndpointSpec:
    """One engine server behind the router."""

    url: str  # base URL of an OpenAI-compatible server, e.g. http://10.0.0.1:8000
    name: str | None = None  # label in metrics and the index; defaults to the URL
    model: str | None = None  # served model; discovered from /v1/models when unset
    kv_events: str | None = None  # its KV event PUB address, e.g. tcp://10.0.0.1:5557
    kv_events_replay: str | None = None  # its replay ROUTER address, e.g. tcp://10.0.0.1:5558
    kv_events_topic: str = ""  # topic prefix to subscribe to ("" = all)
    api_key: str | None = field(default=None, repr=False)  # bearer key the endpoint expects
    # The engine's CURVE public key file when its event sockets use CURVE (default:
    # index.curve_server_key)
    kv_events_curve_server_key: str | None = None
    # P/D: prefill (prefill legs only), decode (whole requests and decode legs) or both.
    # vLLM's kv_producer / kv_consumer / kv_both (and producer / consumer) are accepted.
    role: str = ROLE_BOTH
    # Shared storage tiers the endpoint loads from, by the tier id its engine publishes in
    # KV events and /metrics (``fs:/mnt/kv``, ``redis://10.0.0.7:6379/0``): blocks there count
    # for it from the start (events teach it too, once the engine wrote to the tier).
    shared_tiers: list[str] = field(default_factory=list)
    # A data-parallel server (kvserve.cluster.data_parallel): N ranks on port..port+N-1, each
    # routed to as its own endpoint; data_parallel_rank is set on the expanded rank endpoints.
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if int(self.data_parallel_size) < 1:
            raise ConfigError(f"endpoint {self.url}: data_parallel_size must be >= 1")
        self.data_parallel_size = int(self.data_parallel_size)
        parts = urlsplit(self.url)
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            parts = None
        if not self.url.startswith(("http://", "https://")) or not parts or not parts.hostname:
            raise ConfigError(
                f"endpoint url must be http:// or https:// then host[:port][/path]: {self.url!r}"
            )
        if self.kv_events_replay and not self.kv_events:
            raise ConfigError(f"endpoint {self.url}: kv_events_replay without kv_events")
        if self.kv_events_curve_server_key:
            _check_curve_key(self.kv_events_curve_server_key, secret=False)
        role = _ROLE_ALIASES.get(self.role) if isinstance(self.role, str) else None
        if role is None:
            raise ConfigError(
                f"endpoint {self.url}: role must be prefill, decode or both, got {self.role!r}"
            )
        self.role = role

    @property
    def can_prefill(self) -> bool:
        """May take prefill legs."""
        return self.role != ROLE_DECODE

    @property
    def can_decode(self) -> bool:
        """May take whole requests and decode legs."""
        return self.role != ROLE_PREFILL

    @property
    def key(self) -> str:
        return self.name or self.url


@dataclass
class ScorerSpec:
    name: str  # precise_prefix | approx_prefix | queue_depth | kv_cache_util | load |
    # session_affinity
    weight: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)  # scorer-specific options


@dataclass
class PickerSpec:
    name: str = "max_score"  # max_score | weighted_random | random | round_robin
    params: dict[str, Any] = field(default_factory=dict)


def default_scorers() -> list[ScorerSpec]:
    """precise prefix 3 + load 1 (+ approximate prefix 3 for endpoints without KV events):
    the best configuration of ``benchmarks/bench_routing_quality.py``; see the module doc."""
    return [
        ScorerSpec("precise_prefix", 3.0),
        ScorerSpec("approx_prefix", 3.0),
        ScorerSpec("load", 1.0, {"capacity": 32}),
    ]


@dataclass
class SchedulerConfig:
    filters: list[str] = field(default_factory=lambda: ["model", "healthy"])
    scorers: list[ScorerSpec] = field(default_factory=default_scorers)
    picker: PickerSpec = field(default_factory=PickerSpec)


def default_prefill_scorers() -> list[ScorerSpec]:
    """The prefill pool's profile: its cached prefix (shorter prefill) 3, load 1."""
    return [
        ScorerSpec("precise_prefix", 3.0),
        ScorerSpec("approx_prefix", 3.0),
        ScorerSpec("load", 1.0, {"capacity": 8}),
    ]


@dataclass
class PDConfig:
    """Prefill/decode disaggregation (see the module doc)."""

    # Uncached prompt tokens on the chosen decode endpoint from which a request is split
    # (0: never; P/D is off).
    threshold: int = 0
    prefill_timeout_s: float = 30.0  # the whole prefill leg; past it the decode serves alone
    # A prefill endpoint with this many prefill legs in flight (or requests waiting, scraped)
    # is saturated; when every one is, requests are not split.
    prefill_max_active: int = 8
    prefill_scorers: list[ScorerSpec] = field(default_factory=default_prefill_scorers)
    prefill_picker: PickerSpec = field(default_factory=PickerSpec)

    @property
    def enabled(self) -> bool:
        return self.threshold > 0

    def validate(self) -> None:
        if self.threshold < 0:
            raise ConfigError("pd.threshold must be >= 0 (0: P/D off)")
        if self.prefill_timeout_s <= 0:
            raise ConfigError("pd.prefill_timeout_s must be positive")
        if self.prefill_max_active < 1:
            raise ConfigError("pd.prefill_max_active must be >= 1")


@dataclass
class HealthConfig:
    interval_s: float = 1.0  # GET /health period
    timeout_s: float = 1.0
    unhealthy_after: int = 2  # consecutive failed checks before an endpoint is taken out
    metrics_interval_s: float = 0.5  # GET /metrics period (load, queue, KV usage)


@dataclass
class IndexConfig:
    max_blocks_per_endpoint: int = 2_000_000  # LRU bound of the KV index per endpoint
    tier_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    replay_timeout_s: float = 2.0  # give up on a replay request after this long
    # CURVE on the engines' event sockets (ZeroMQ key files, see kvserve/kv/event_curve.py):
    curve_client_key: str | None = None  # the router's .key_secret file
    curve_server_key: str | None = None  # engines' public key file, unless an endpoint has one

    def __post_init__(self) -> None:
        if self.curve_client_key:
            _check_curve_key(self.curve_client_key, secret=True)
        if self.curve_server_key:
            _check_curve_key(self.curve_server_key, secret=False)


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # Also serve as a Gateway API Inference Extension Endpoint Picker (Envoy ext_proc gRPC)
    # on this port (``kvserve route --epp``; None: not an EPP).
    epp_port: int | None = None
    # The EPP's gRPC transport: loop (kvserve's HTTP/2 server in the event loop) | grpcio
    epp_transport: str = "loop"
    endpoints: list[EndpointSpec] = field(default_factory=list)
    endpoints_file: str | None = None  # YAML/JSON list of endpoints, re-read when it changes
    endpoints_file_poll_s: float = 1.0
    # DNS discovery (headless Services): dns://NAME[:PORT][,events=tcp://{host}:5557,...],
    # each address one endpoint (see kvserve/cluster/discovery.py), resolved every poll.
    endpoints_dns: list[str] = field(default_factory=list)
    endpoints_dns_poll_s: float = 5.0
    tokenizer: str | None = None  # model directory whose tokenizer serves every model
    tokenizers: dict[str, str] = field(default_factory=dict)  # model name -> model directory
    block_size: int = 16  # block size of the routing history (approximate prefix)
    prefix_hash_seed: str = DEFAULT_PREFIX_HASH_SEED  # the router's own key space
    session_header: str = "x-session-id"
    max_attempts: int = 3  # endpoints tried per request (failover before the first byte)
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 600.0  # upstream response headers must arrive by then
    history_ttl_s: float = 600.0  # routing history entry lifetime (approximate prefix)
    history_max_blocks: int = 1_000_000
    session_ttl_s: float = 3600.0
    inline_tokenize_chars: int = 4096  # longer prompts are tokenized on a worker thread
    # Prompt tokens computed for scoring (None: the largest max_model_len the endpoints
    # report, else 131072): a longer prompt is tokenized only that far.
    tokenize_max_tokens: int | None = None
    tokenize_threads: int = 2
    tokenize_max_pending: int = 64  # beyond, long prompts route on their raw text
    # Clients' bearer keys (none: no authentication) and what else they guard.
    api_keys: list[str] = field(default_factory=list, repr=False)
    api_key_metrics: bool = False  # /metrics needs a key too
    api_key_admin: bool = True  # /router/state needs a key too
    upstream_api_key: str | None = field(default=None, repr=False)  # to endpoints without one
    # The router's own HTTP server.
    max_body_bytes: int = 64 << 20
    header_timeout_s: float = 10.0  # request line + headers must arrive within this
    body_timeout_s: float = 60.0  # the body within this after the headers
    keep_alive_timeout_s: float = 30.0  # idle kept-alive client connections are closed
    # Overload: connections per endpoint, then a bounded queue, then 503 + Retry-After.
    max_connections_per_endpoint: int = 256
    max_queue_per_endpoint: int = 1024
    queue_timeout_s: float = 60.0  # longest wait for a connection before 503
    retry_after_s: int = 1  # Retry-After of overload answers
    log_level: str = "warning"
    # auto: uvloop when it is installed (it cuts the router's CPU per request), else asyncio
    event_loop: str = "auto"  # auto | uvloop | asyncio
    health: HealthConfig = field(default_factory=HealthConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pd: PDConfig = field(default_factory=PDConfig)

    def validate(self) -> RouterConfig:
        if self.block_size <= 0:
            raise ConfigError("block_size must be positive")
        if self.event_loop not in ("auto", "uvloop", "asyncio"):
            raise ConfigError("event_loop must be auto, uvloop or asyncio")
        if self.max_attempts < 1:
            raise ConfigError("max_attempts must be >= 1")
        if self.epp_port is not None and not 0 <= self.epp_port <= 65535:
            raise ConfigError("epp_port must be a port number")
        if self.epp_transport not in ("loop", "grpcio"):
            raise ConfigError("epp_transport must be loop or grpcio")
        for name in (
            "max_body_bytes",
            "max_connections_per_endpoint",
            "tokenize_threads",
            "header_timeout_s",
            "body_timeout_s",
            "keep_alive_timeout_s",
            "queue_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.max_queue_per_endpoint < 0 or self.retry_after_s < 0:
            raise ConfigError("max_queue_per_endpoint and retry_after_s must be >= 0")
        if self.tokenize_max_tokens is not None and self.tokenize_max_tokens <= 0:
            raise ConfigError("tokenize_max_tokens must be positive")
        if any(not k for k in self.api_keys):
            raise ConfigError("api_keys must not be empty strings")
        if not self.endpoints and not self.endpoints_file and not self.endpoints_dns:
            raise ConfigError("no endpoints: give `endpoints`, `endpoints_file` or `endpoints_dns`")
        if self.endpoints_file_poll_s <= 0 or self.endpoints_dns_poll_s <= 0:
            raise ConfigError("endpoints_file_poll_s and endpoints_dns_poll_s must be positive")
        from kvserve.cluster.discovery import DnsSource

        for target in self.endpoints_dns:  # a bad target or template fails at startup
            DnsSource(target)
        from kvserve.cluster.data_parallel import expand_data_parallel

        self.endpoints = expand_data_parallel(self.endpoints)
        names = [e.key for e in self.endpoints]
        if len(set(names)) != len(names):
            raise ConfigError("duplicate endpoint names/urls")
        self.pd.validate()
        return self


# ---------------------------------------------------------------------------------------------
# dict -> dataclass


def _build(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if tp is EndpointSpec and isinstance(value, str):
            value = {"url": value}
        if tp is ScorerSpec and isinstance(value, str):
            value = {"name": value}
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(value) - names
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
        kwargs = {k: _build(hints[k], v, f"{where}.{k}" if where else k) for k, v in value.items()}
        try:
            return tp(**kwargs)
        except TypeError as e:
            raise ConfigError(f"{where or 'config'}: {e}") from None
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list")
        return [_build(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping")
        return {str(k): _build(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _build(inner[0], value, where)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected int, got {value!r}")
    if tp is float:
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    return value


def router_config_from_dict(data: dict[str, Any]) -> RouterConfig:
    return _build(RouterConfig, data or {}, "")


def read_structured_file(path: str) -> Any:
    """Parse a YAML or JSON file (JSON is YAML, but keep JSON errors JSON-shaped)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        return json.loads(text)
    return yaml.safe_load(text)


def load_router_config(path: str) -> RouterConfig:
    try:
        data = read_structured_file(path)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read router config {path}: {e}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    cfg = router_config_from_dict(data or {})
    if cfg.endpoints_file and not os.path.isabs(cfg.endpoints_file):
        cfg.endpoints_file = os.path.join(
            os.path.dirname(os.path.abspath(path)), cfg.endpoints_file
        )
    return cfg


def parse_endpoints(data: Any, where: str = "endpoints") -> list[EndpointSpec]:
    """Endpoints from a parsed file: a list, or a mapping with an ``endpoints`` list."""
    if isinstance(data, dict) and "endpoints" in data:
        data = data["endpoints"]
    if data is None:
        return []
    from kvserve.cluster.data_parallel import expand_data_parallel

    return expand_data_parallel(_build(list[EndpointSpec], data, where))
