"""The router process: an OpenAI-compatible HTTP gateway in front of many engine servers.

Owns the request path (parse -> tokenize/hash -> schedule -> proxy with failover -> relay)
and the wiring of the parts: endpoint pool, KV index + event subscriber, routing history,
scheduler, metrics. The wire on both sides is the router's own lean HTTP/1.1
(:mod:`~kvserve.cluster.http_server`, :mod:`~kvserve.cluster.upstream`): a proxied request
is one parse, one routing decision and one write each way. Responses are relayed as they
arrive (streams piece by piece); a request is retried on the next-ranked endpoint only while
nothing has been sent to the client (connection failure, timeout before headers, a 5xx or a
429, or no connection free to that endpoint); a client that disconnects cancels its handler,
which closes the upstream connection so the engine aborts the request.

Overload degrades instead of collapsing: connections per endpoint are capped and requests
queue for them (bounded); when every candidate's queue is full the client gets 503 with
``Retry-After``. An endpoint leaves the rotation only on evidence it is down (a refused
connection, failed health checks); a connect timeout or a dropped connection asks for a
health check now, since under a burst they are the router's own load showing.

Prefill/decode disaggregation (``pd.threshold`` > 0): the scheduler's decision says
whether a request is split (:mod:`kvserve.cluster.disaggregation`); a split request is
carried out by vLLM's contract. The prefill leg is the client's body with ``max_tokens`` 1
(and ``max_completion_tokens``, ``min_tokens`` when given), no streaming, no ``stream_options`` and
``kv_transfer_params: {"do_remote_decode": true}``, sent to the prefill endpoint (with the
same authentication as any upstream request) and given ``pd.prefill_timeout_s`` in all;
the ``kv_transfer_params`` of its JSON answer go into the decode leg, the client's body
otherwise unchanged (streamed as the client asked), which fails over to the next decode
endpoint before the first byte like any request (the new one pulls from the same
producer). A prefill leg that fails (refused, error status, timeout, no
``kv_transfer_params`` in its answer) is not retried elsewhere: the decode endpoint serves
the client's body alone, prefilling itself. A client that disconnects cancels its handler,
which closes whichever leg is in flight, so the engine aborts it. Responses say what
happened: ``x-kvserve-disaggregated`` (true/false), ``x-kvserve-pd-reason``,
``x-kvserve-decode-endpoint`` and, when a prefill leg ran, ``x-kvserve-prefill-endpoint``.

Authentication (when API keys are configured): ``/v1/*`` (and ``/router/state``, optionally
``/metrics``) need ``Authorization: Bearer <key>``, compared in constant time (digests of
equal length); the engines get the endpoint's own key, else the upstream key, else the
client's header as it came.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import hmac
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kvserve
from kvserve.cluster.config import RouterConfig
from kvserve.cluster.endpoints import Endpoint, EndpointPool
from kvserve.cluster.event_subscriber import EventSubscriber
from kvserve.cluster.filters import NoEndpointError
from kvserve.cluster.headers import ENDPOINT_HEADER
from kvserve.cluster.history import RoutingHistory, SessionTable
from kvserve.cluster.http_server import HttpRequest, HttpResponse, HttpServer
from kvserve.cluster.kv_index import KVIndex
from kvserve.cluster.metrics import RouterMetrics
from kvserve.cluster.routing_request import RoutingRequest
from kvserve.cluster.scheduler import Decision, Scheduler
from kvserve.cluster.tokenization import (
    DEFAULT_MAX_TOKENS,
    BadRequestError,
    TokenizerRegistry,
    TokenizerWorkers,
    prompt_chars,
    routing_request,
)
from kvserve.cluster.upstream import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamSaturated,
    UpstreamTimeout,
)

logger = logging.getLogger(__name__)

_ENDPOINT_HEADER_B = ENDPOINT_HEADER.encode()
# With P/D on, on every proxied response:
DISAGGREGATED_HEADER = "x-kvserve-disaggregated"  # true: prefill and decode legs ran
PD_REASON_HEADER = "x-kvserve-pd-reason"  # the decision's reason, or why the prefill failed
PREFILL_ENDPOINT_HEADER = "x-kvserve-prefill-endpoint"  # where the prefill leg went
DECODE_ENDPOINT_HEADER = "x-kvserve-decode-endpoint"  # who decoded (served the response)
_DECODE_ENDPOINT_HEADER_B = DECODE_ENDPOINT_HEADER.encode()
# Request headers not forwarded: hop-by-hop ones and those the upstream request sets itself.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",
        b"http2-settings",
    }
)
_KEEP_RESPONSE_HEADERS = frozenset(
    {b"content-type", b"x-request-id", b"cache-control", b"retry-after"}
)
# Engine answers that mean "not now, try elsewhere" rather than "this request is bad".
_RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
_INLINE_TOKENS = 4096  # token-id prompts longer than this are hashed on a worker thread
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
_JSON = [(b"content-type", b"application/json")]

Reply = tuple[int, list[tuple[bytes, bytes]], bytes]  # status, headers, body


class UpstreamFailed(Exception):
    """An attempt failed before anything reached the client (safe to retry elsewhere).

    ``endpoint_down``: proof the endpoint is down (refused); ``suspect``: maybe down, check
    it now; ``overload``: the endpoint (or our connections to it) is saturated."""

    def __init__(
        self,
        kind: str,
        detail: str,
        endpoint_down: bool = False,
        *,
        suspect: bool = False,
        overload: bool = False,
    ) -> None:
        super().__init__(detail)
        self.kind = kind
        self.endpoint_down = endpoint_down
        self.suspect = suspect
        self.overload = overload


def error_reply(
    status: int,
    message: str,
    etype: str = "invalid_request_error",
    code: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> Reply:
    """An OpenAI-style error body (``code``: a string or null, as OpenAI's)."""
    body = {"error": {"message": message, "type": etype, "param": None, "code": code}}
    return status, _JSON + headers if headers else _JSON, _json_encode(body)


def json_reply(obj: Any, status: int = 200) -> Reply:
    return status, _JSON, _json_encode(obj)


class Router:
    """All of `kvserve route` but the process entry point (see :mod:`kvserve.cluster.cli`)."""

    def __init__(self, config: RouterConfig) -> None:
        config.validate()
        self.config = config
        self.index = KVIndex(
            seed=config.prefix_hash_seed,
            max_blocks_per_endpoint=config.index.max_blocks_per_endpoint,
            tier_weights=config.index.tier_weights,
        )
        self.subscriber = EventSubscriber(
            self.index,
            replay_timeout=config.index.replay_timeout_s,
            curve_client_key=config.index.curve_client_key,
        )
        self.history = RoutingHistory(config.history_ttl_s, config.history_max_blocks)
        self.sessions = SessionTable(config.session_ttl_s)
        self.history_block_size = config.block_size
        self.scheduler = Scheduler.from_config(config.scheduler, self, config.pd)
        self.tokenizers = TokenizerRegistry(config.tokenizer, config.tokenizers)
        self.tokenize_workers = TokenizerWorkers(
            config.tokenize_threads, config.tokenize_max_pending
        )
        self.pool = EndpointPool.from_config(config)  # static, file and DNS endpoints
        self.pool.on_added.append(self._endpoint_added)
        self.pool.on_removed.append(self._endpoint_removed)
        self.upstream = UpstreamPool(
            connect_timeout_s=config.connect_timeout_s,
            max_connections=config.max_connections_per_endpoint,
            max_idle_per_origin=config.max_connections_per_endpoint,
            max_queue=config.max_queue_per_endpoint,
            queue_timeout_s=config.queue_timeout_s,
        )
        self.metrics = RouterMetrics(
            lambda: (self.pool, self.index, self.subscriber, self.upstream)
        )
        self._server: HttpServer | None = None
        self._pruner: asyncio.Task | None = None
        self._routes: dict[tuple[str, str], Callable[[HttpRequest, HttpResponse], Awaitable]]
        self._routes = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self._simple(self.models),
            ("GET", "/health"): self._simple(self.health),
            ("GET", "/metrics"): self._simple(self.prometheus),
            ("GET", "/router/state"): self._simple(self.state),
            ("GET", "/version"): self._simple(lambda: json_reply({"version": kvserve.__version__})),
            ("GET", "/openapi.json"): self.openapi,
        }
        self._allowed: dict[str, list[str]] = {}  # path -> its methods (the Allow header)
        for method, path in self._routes:
            self._allowed.setdefault(path, []).append(method)
        # Authentication: digests of the keys (compared in constant time, equal lengths).
        self._key_digests = [hashlib.sha256(k.encode()).digest() for k in config.api_keys]
        self._secured_exact = frozenset(
            ["/router/state"] * config.api_key_admin + ["/metrics"] * config.api_key_metrics
        )
        self._retry_after = [(b"retry-after", str(config.retry_after_s).encode())]
        self._openapi: bytes | None = None
        self._session_header = config.session_header.lower().encode("latin-1")
        self.port: int | None = None

    # ------------------------------------------------------------------ lifecycle

    def _endpoint_added(self, ep: Endpoint) -> None:
        for tier in ep.spec.shared_tiers:
            self.index.add_tier_member(ep.name, tier)
        if ep.spec.kv_events:
            self.subscriber.add_endpoint(
                ep.name,
                ep.spec.kv_events,
                ep.spec.kv_events_replay,
                ep.spec.kv_events_topic,
                curve_server_key=ep.spec.kv_events_curve_server_key
                or self.config.index.curve_server_key,
            )

    def _endpoint_removed(self, ep: Endpoint) -> None:
        self.subscriber.remove_endpoint(ep.name)  # also drops it from the index
        self.index.remove_endpoint(ep.name)
        self.history.forget(ep.name)
        self.sessions.forget_endpoint(ep.name)
        self.upstream.close_origin(ep.origin)

    async def start_core(self) -> None:
        """Start what every front end needs (event subscriber, endpoint upkeep); returns once
        every endpoint was checked once, i.e. when the view of the endpoints is synced."""
        self.subscriber.start()
        await self.pool.start()  # health checks on connections of their own

    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Start everything and listen; returns the bound port (``port=0``: a free one)."""
        await self.start_core()
        cfg = self.config
        self._server = HttpServer(
            self._dispatch,
            error_reply,
            max_body_bytes=cfg.max_body_bytes,
            header_timeout_s=cfg.header_timeout_s,
            body_timeout_s=cfg.body_timeout_s,
            keep_alive_timeout_s=cfg.keep_alive_timeout_s,
        )
        self.port = await self._server.start(
            self.config.host if host is None else host,
            self.config.port if port is None else port,
        )
        self._pruner = asyncio.get_running_loop().create_task(self._prune_idle())
        return self.port

    async def stop(self) -> None:
        if self._pruner is not None:
            self._pruner.cancel()
            self._pruner = None
        if self._server is not None:
            await self._server.close()
            self._server = None
        await self.pool.stop()
        await self.upstream.close()
        self.subscriber.close()
        self.tokenize_workers.shutdown()

    async def _prune_idle(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.upstream.prune()

    # ------------------------------------------------------------------ dispatch

    async def _dispatch(self, req: HttpRequest, resp: HttpResponse) -> None:
        if self._key_digests and self._secured(req.path) and not self._authorized(req):
            self.metrics.rejected_of(401).inc()
            resp.send(
                *error_reply(
                    401,
                    "Incorrect API key provided: send `Authorization: Bearer <key>`.",
                    code="invalid_api_key",
                    headers=[(b"www-authenticate", b"Bearer")],
                )
            )
            return
        handler = self._routes.get((req.method, req.path))
        if handler is not None:
            await handler(req, resp)
        elif req.path in self._allowed:
            allow = ", ".join(self._allowed[req.path]).encode()
            resp.send(
                *error_reply(
                    405,
                    f"Method {req.method} not allowed on {req.path}.",
                    headers=[(b"allow", allow)],
                )
            )
        else:
            resp.send(*error_reply(404, f"Invalid URL ({req.method} {req.path})"))

    def _secured(self, path: str) -> bool:
        return path.startswith("/v1/") or path in self._secured_exact

    def needs_key(self, path: str) -> bool:
        """Whether a request to ``path`` must carry one of the configured API keys."""
        return bool(self._key_digests) and self._secured(path)

    def _authorized(self, req: HttpRequest) -> bool:
        return self.authorized(req.header(b"authorization"))

    def authorized(self, value: str | None) -> bool:
        """An ``Authorization`` value with a bearer key equal to one of ours (every key
        compared, in constant time)."""
        if value is None:
            return False
        scheme, _, token = value.strip().partition(" ")
        digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
        ok = False
        for key in self._key_digests:
            ok |= hmac.compare_digest(digest, key)
        return ok and scheme.lower() == "bearer"

    @staticmethod
    def _simple(fn: Callable[[], Reply]) -> Callable[[HttpRequest, HttpResponse], Awaitable]:
        async def handle(req: HttpRequest, resp: HttpResponse) -> None:
            resp.send(*fn())

        return handle

    # ------------------------------------------------------------------ small handlers

    def models(self) -> Reply:
        cards: dict[str, dict] = {}
        for ep in self.pool.healthy():
            for card in ep.model_cards or [{"id": m, "object": "model"} for m in ep.models]:
                cards.setdefault(str(card["id"]), card)
            for m in ep.models:
                cards.setdefault(m, {"id": m, "object": "model", "owned_by": "kvserve"})
        return json_reply({"object": "list", "data": list(cards.values())})

    def health(self) -> Reply:
        n = len(self.pool.healthy())
        return json_reply(
            {"status": "ok" if n else "unavailable", "healthy_endpoints": n},
            status=200 if n else 503,
        )

    async def openapi(self, req: HttpRequest, resp: HttpResponse) -> None:
        if self._openapi is None:  # built once, off the loop (imports the wire models)
            from kvserve.cluster.openapi import router_openapi

            secured = {p for p in self._allowed if self._key_digests and self._secured(p)}
            doc = await asyncio.to_thread(router_openapi, secured)
            self._openapi = _json_encode(doc)
        resp.send(200, _JSON, self._openapi)

    def prometheus(self) -> Reply:
        body = generate_latest(self.metrics.registry)
        return 200, [(b"content-type", CONTENT_TYPE_LATEST.encode())], body

    def state(self) -> Reply:
        streams = self.subscriber.all_stats()
        eps = []
        for ep in self.pool.endpoints.values():
            st = streams.get(ep.name)
            eps.append(
                {
                    "name": ep.name,
                    "url": ep.url,
                    "role": ep.spec.role,
                    "models": list(ep.models),
                    "healthy": ep.healthy,
                    "last_error": ep.last_error,
                    "in_flight": ep.in_flight,
                    "prefill_in_flight": ep.prefill_in_flight,
                    "connections": self.upstream.busy(ep.origin),
                    "queued": self.upstream.queued(ep.origin),
                    "ejections": ep.ejections,
                    "running": ep.num_requests_running,
                    "waiting": ep.num_requests_waiting,
                    "kv_cache_usage": ep.kv_cache_usage_perc,
                    "kv_blocks": self.index.endpoint_num_blocks(ep.name),
                    "kv_events": None
                    if st is None
                    else {
                        "last_seq": st.last_seq,
                        "batches": st.batches,
                        "gaps": st.gaps,
                        "missed_batches": st.missed_batches,
                        "lag_s": st.lag_s,
                    },
                }
            )
        return json_reply({"endpoints": eps, "kv_index_blocks": self.index.num_blocks})

    # ------------------------------------------------------------------ proxy

    async def completions(self, req: HttpRequest, resp: HttpResponse) -> None:
        await self._proxy(req, resp, chat=False)

    async def chat_completions(self, req: HttpRequest, resp: HttpResponse) -> None:
        await self._proxy(req, resp, chat=True)

    def _max_tokens(self, model: Any) -> int:
        """Prompt tokens worth computing for scoring: the largest context of the endpoints
        that serve ``model`` (what any of them could hold), unless configured."""
        if self.config.tokenize_max_tokens is not None:
            return self.config.tokenize_max_tokens
        lens = [
            e.max_model_len
            for e in self.pool.endpoints.values()
            if e.max_model_len and (not isinstance(model, str) or e.serves(model))
        ]
        return max(lens) if lens else DEFAULT_MAX_TOKENS

    def _long(self, body: dict[str, Any], chat: bool) -> bool:
        """Whether the prompt is tokenized and hashed off the event loop."""
        prompt = body.get("prompt")
        long_ids = isinstance(prompt, list) and len(prompt) > _INLINE_TOKENS
        return long_ids or prompt_chars(body, chat) > self.config.inline_tokenize_chars

    def _build_request(
        self,
        body: dict[str, Any],
        chat: bool,
        session_id: str | None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        tokenize: bool = True,
    ) -> RoutingRequest:
        req = routing_request(
            body,
            chat,
            self.tokenizers if tokenize else None,
            session_id=session_id,
            seed=self.config.prefix_hash_seed,
            max_tokens=max_tokens,
        )
        if req.token_ids is not None and len(req.token_ids) > _INLINE_TOKENS:
            for bs in {self.index.endpoint_block_size(n) for n in self.pool.endpoints}:
                if bs:
                    req.block_keys(bs)  # hash here, off the event loop
        return req

    async def _routing_request(
        self, body: dict[str, Any], chat: bool, session_id: str | None
    ) -> RoutingRequest:
        if not self._long(body, chat):
            return self._build_request(body, chat, session_id)
        build = functools.partial(
            self._build_request, body, chat, session_id, self._max_tokens(body.get("model"))
        )
        fut = self.tokenize_workers.submit(build)
        if fut is None:  # the tokenizer threads are swamped: route on the raw text
            return build(tokenize=False)
        return await asyncio.wrap_future(fut)

    async def decide(
        self,
        body: dict[str, Any],
        chat: bool,
        session_id: str | None,
        endpoints: list[Endpoint] | None = None,
        *,
        split: bool = True,
    ) -> tuple[RoutingRequest, Decision]:
        """The scheduling core every front end calls: tokenize/hash ``body`` (long prompts
        off the loop) and rank ``endpoints`` (default: all). ``split``: a P/D split may be
        decided (a front end that cannot run a prefill leg passes False). Raises
        :class:`BadRequestError` or :class:`NoEndpointError`."""
        req = await self._routing_request(body, chat, session_id)
        return req, self._schedule(req, body, endpoints, split)

    def decide_now(
        self,
        body: dict[str, Any],
        chat: bool,
        session_id: str | None,
        endpoints: list[Endpoint] | None = None,
        *,
        split: bool = True,
    ) -> tuple[RoutingRequest, Decision] | None:
        """:meth:`decide` without leaving the event loop (a front end answering in its
        protocol's callback), or None when the prompt is long enough to be tokenized off
        the loop: then await :meth:`decide`."""
        if self._long(body, chat):
            return None
        req = self._build_request(body, chat, session_id)
        return req, self._schedule(req, body, endpoints, split)

    def _schedule(
        self,
        req: RoutingRequest,
        body: dict[str, Any],
        endpoints: list[Endpoint] | None,
        split: bool,
    ) -> Decision:
        if self.scheduler.disaggregator is not None:
            req.pd_skip = _pd_skip(body) if split else "front_end"
        if endpoints is None:
            endpoints = list(self.pool.endpoints.values())
        return self.scheduler.schedule(req, endpoints)

    async def _proxy(self, request: HttpRequest, resp: HttpResponse, chat: bool) -> None:
        t0 = time.perf_counter()
        try:
            body = _json_decode(request.body)
        except (msgspec.DecodeError, UnicodeDecodeError):
            self.metrics.rejected_of(400).inc()
            resp.send(*error_reply(400, "request body is not valid JSON"))
            return
        except RecursionError:
            self.metrics.rejected_of(400).inc()
            resp.send(*error_reply(400, "request body is nested too deeply"))
            return
        if not isinstance(body, dict):
            self.metrics.rejected_of(400).inc()
            resp.send(*error_reply(400, "request body must be a JSON object"))
            return
        session_id = request.header(self._session_header)
        try:
            req, decision = await self.decide(body, chat, session_id)
        except BadRequestError as e:
            self.metrics.rejected_of(400).inc()
            resp.send(*error_reply(400, str(e)))
            return
        except NoEndpointError as e:
            self.metrics.rejected_of(e.status).inc()
            if e.status == 404:
                resp.send(*error_reply(404, e.message, code="model_not_found"))
            else:
                resp.send(
                    *error_reply(
                        e.status, e.message, "service_unavailable", None, self._retry_after
                    )
                )
            return
        await self._forward(request, resp, req, decision, time.perf_counter() - t0, body)

    async def _forward(
        self,
        request: HttpRequest,
        resp: HttpResponse,
        req: RoutingRequest,
        decision: Decision,
        routing_s: float,
        body: dict[str, Any],
    ) -> None:
        headers, client_auth = _forwarded_headers(request.headers)
        data = request.body
        pd_headers: list[tuple[bytes, bytes]] | None = None
        if decision.pd is not None:
            decode = decision.ranked[0]
            decode.in_flight += 1  # committed to it while the prefill leg runs (load scorer)
            try:
                data, pd_headers = await self._disaggregate(
                    request, req, decision, headers, client_auth, body
                )
            finally:
                decode.in_flight -= 1
        attempts = decision.ranked[: self.config.max_attempts]
        last_error = "no endpoint tried"
        overloaded = False
        metrics = self.metrics
        for i, ep in enumerate(attempts):
            if i > 0 and not ep.healthy:
                continue
            auth = ep.auth_header or client_auth
            ep.in_flight += 1

            def sent(ep: Endpoint = ep, first: bool = i == 0) -> None:
                # While the endpoint works: bookkeeping off the critical path. The routing
                # history learns where the prefix went as soon as it is on its way there.
                self.scheduler.observe(req, ep)
                if first:
                    metrics.routing_time.observe(routing_s)

            try:
                t_send = time.perf_counter()
                try:
                    upstream = await self._send(
                        ep,
                        request.path,
                        data,
                        headers + [auth] if auth else headers,
                        last=i == len(attempts) - 1,
                        on_sent=sent,
                    )
                except UpstreamFailed as e:
                    last_error = f"{ep.name}: {e}"
                    overloaded = overloaded or e.overload
                    self.metrics.failovers_of(ep.name, e.kind).inc()
                    if e.endpoint_down:
                        self.pool.mark_failed(ep, str(e))
                    elif e.suspect:
                        self.pool.probe_soon(ep)
                    logger.info("attempt %d on %s failed (%s); failing over", i + 1, ep.name, e)
                    continue
                t_first = time.perf_counter()
                ep.answered_at = time.monotonic()
                try:
                    await self._relay(resp, upstream, ep, pd_headers)
                    return
                finally:
                    metrics.first_byte_of(ep.name).observe(t_first - t_send)
                    metrics.decisions_of(decision.reason if i == 0 else "failover").inc()
                    metrics.latency_of(ep.name).observe(time.perf_counter() - t_send)
                    metrics.requests_of(ep.name, upstream.status).inc()
            finally:
                ep.in_flight -= 1
        if overloaded:  # some endpoint was only busy: come back later
            self.metrics.rejected_of(503).inc()
            resp.send(
                *error_reply(
                    503,
                    f"The endpoints are overloaded; retry later ({last_error})",
                    "service_unavailable",
                    None,
                    self._retry_after,
                )
            )
            return
        self.metrics.rejected_of(502).inc()
        resp.send(*error_reply(502, f"all endpoints failed ({last_error})", "bad_gateway"))

    async def _disaggregate(
        self,
        request: HttpRequest,
        req: RoutingRequest,
        decision: Decision,
        headers: list[tuple[bytes, bytes]],
        client_auth: tuple[bytes, bytes] | None,
        body: dict[str, Any],
    ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """Carry out a P/D decision up to the decode leg: run the prefill leg if the request
        is split; returns the decode leg's body and the P/D response headers."""
        pd = decision.pd
        assert pd is not None
        self.metrics.pd_decisions_of("true" if pd.disaggregate else "false", pd.reason).inc()
        data, split, reason = request.body, False, pd.reason
        out: list[tuple[bytes, bytes]] = []
        if pd.prefill is not None:
            ep = pd.prefill
            out.append((PREFILL_ENDPOINT_HEADER.encode(), ep.name.encode("latin-1")))
            params, error = await self._prefill_leg(
                ep, request.path, req, headers, client_auth, body
            )
            if params is not None:
                data, split = _json_encode({**body, "kv_transfer_params": params}), True
            else:
                reason = f"prefill_failed:{error}"
                self.metrics.pd_fallbacks_of(error).inc()
                logger.info("prefill leg on %s failed (%s): decode alone", ep.name, error)
        out.append((DISAGGREGATED_HEADER.encode(), b"true" if split else b"false"))
        out.append((PD_REASON_HEADER.encode(), reason.encode("latin-1")))
        return data, out

    async def _prefill_leg(
        self,
        ep: Endpoint,
        path: str,
        req: RoutingRequest,
        headers: list[tuple[bytes, bytes]],
        client_auth: tuple[bytes, bytes] | None,
        body: dict[str, Any],
    ) -> tuple[dict[str, Any] | None, str]:
        """The prefill leg on ``ep``: its answer's ``kv_transfer_params``, else (None, why)."""
        leg = dict(body)
        leg["max_tokens"] = 1
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        if isinstance(leg.get("min_tokens"), int) and leg["min_tokens"] > 1:
            leg["min_tokens"] = 1  # vLLM refuses min_tokens > max_tokens
        leg["stream"] = False
        leg.pop("stream_options", None)
        leg["kv_transfer_params"] = {"do_remote_decode": True}
        auth = ep.auth_header or client_auth
        disaggregator = self.scheduler.disaggregator
        assert disaggregator is not None
        ep.in_flight += 1
        ep.prefill_in_flight += 1
        t0 = time.perf_counter()
        upstream: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(self.config.pd.prefill_timeout_s):
                upstream = await self.upstream.request(
                    ep.origin,
                    "POST",
                    path,
                    headers + [auth] if auth else headers,
                    _json_encode(leg),
                    first_byte_timeout_s=None,
                    on_sent=lambda: disaggregator.observe(req, ep),
                )
                raw = await upstream.read(None)
            status = upstream.status
            upstream.release()
            upstream = None
        except TimeoutError:
            return None, "timeout"
        except UpstreamSaturated:
            return None, "saturated"
        except UpstreamConnectError as e:
            if e.refused:
                self.pool.mark_failed(ep, str(e))
            else:
                self.pool.probe_soon(ep)
            return None, "connect"
        except (UpstreamError, OSError):
            self.pool.probe_soon(ep)
            return None, "disconnect"
        finally:
            ep.in_flight -= 1
            ep.prefill_in_flight -= 1
            if upstream is not None:  # not read to the end (timeout, cancelled): abort it
                upstream.close()
        ep.answered_at = time.monotonic()
        if status != 200:
            return None, f"http_{status}"
        try:
            answer = _json_decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return None, "bad_json"
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            return None, "no_kv_transfer_params"
        self.metrics.pd_prefill_of(ep.name).observe(time.perf_counter() - t0)
        return params, ""

    async def _send(
        self,
        ep: Endpoint,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        last: bool,
        on_sent: Callable[[], None],
    ) -> UpstreamResponse:
        try:
            upstream = await self.upstream.request(
                ep.origin,
                "POST",
                path,
                headers,
                body,
                first_byte_timeout_s=self.config.first_byte_timeout_s,
                on_sent=on_sent,
            )
        except UpstreamSaturated as e:
            raise UpstreamFailed("saturated", str(e), overload=True) from None
        except UpstreamConnectError as e:
            if e.refused:  # nothing listens: down
                raise UpstreamFailed("connect", str(e), endpoint_down=True) from None
            # A timeout: a full accept backlog (overload) as often as a dead host.
            raise UpstreamFailed("connect", str(e), suspect=True, overload=True) from None
        except UpstreamTimeout:
            raise UpstreamFailed("timeout", "no response headers in time") from None
        except (UpstreamDisconnected, OSError) as e:
            # e.g. the engine died mid-request, or shed the connection under load.
            raise UpstreamFailed("disconnect", f"{type(e).__name__}: {e}", suspect=True) from None
        if upstream.status in _RETRYABLE_STATUSES and not last:
            upstream.close()
            raise UpstreamFailed(
                f"http_{upstream.status}",
                f"HTTP {upstream.status}",
                overload=upstream.status in (429, 503),
            )
        return upstream

    async def _relay(
        self,
        resp: HttpResponse,
        upstream: UpstreamResponse,
        ep: Endpoint,
        pd_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        out_headers = [(k, v) for k, v in upstream.headers if k.lower() in _KEEP_RESPONSE_HEADERS]
        out_headers.append((_ENDPOINT_HEADER_B, ep.name.encode("latin-1")))
        if pd_headers is not None:
            out_headers += pd_headers
            out_headers.append((_DECODE_ENDPOINT_HEADER_B, ep.name.encode("latin-1")))
        timeout = self.config.first_byte_timeout_s
        done = False
        try:
            if upstream.content_length is not None and not upstream.content_type.startswith(
                "text/event-stream"
            ):
                if upstream.complete:  # the usual case: it all came with the headers
                    data = upstream.take_buffered()
                else:
                    data = await upstream.read(timeout)
                done = True
                resp.send(upstream.status, out_headers, data)
                return
            resp.start(upstream.status, out_headers)
            while (piece := await upstream.next_piece(timeout)) is not None:
                await resp.write(piece)
            resp.end()
            done = True
        except UpstreamError as e:
            # The endpoint failed after answering: too late to retry elsewhere.
            logger.warning("upstream %s failed mid-response: %s", ep.name, e)
            if not resp.started:
                resp.send(*error_reply(502, f"{ep.name} failed mid-response: {e}", "bad_gateway"))
            else:
                resp.abort()  # the client sees a truncated stream, not success
        finally:
            if done:
                upstream.release()
            else:
                # Client gone (handler cancelled) or write failed: close the upstream
                # connection so the engine sees the disconnect and aborts the request.
                upstream.close()


def _pd_skip(body: dict[str, Any]) -> str | None:
    """Why a request must not be split, else None."""
    if "kv_transfer_params" in body:  # the client drives P/D itself
        return "client_kv_transfer_params"
    for k in ("n", "best_of"):
        if body.get(k) not in (None, 1):
            return "n_gt_1"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and type(prompt[0]) is not int:
        return "batch_prompt"
    return None


def _forwarded_headers(
    headers: list[tuple[bytes, bytes]],
) -> tuple[list[tuple[bytes, bytes]], tuple[bytes, bytes] | None]:
    """The request headers an engine gets (hop-by-hop ones dropped, including those the
    ``Connection`` header names), and the client's ``Authorization`` apart."""
    drop = _HOP_BY_HOP
    for k, v in headers:
        if k.lower() == b"connection":
            named = {t.strip().lower() for t in v.split(b",")}
            drop = drop | named
    out, auth = [], None
    for k, v in headers:
        lk = k.lower()
        if lk == b"authorization":
            auth = (k, v)
        elif lk not in drop:
            out.append((k, v))
    return out, auth


async def serve_forever(router: Router) -> None:
    await router.start()
    # What exists now lives as long as the process: keep it out of every garbage collection.
    gc.collect()
    gc.freeze()
    logger.warning("kvserve route listening on http://%s:%s", router.config.host, router.port)
    try:
        await wait_for_stop_signal()
    finally:
        await router.stop()


async def wait_for_stop_signal() -> None:
    """Return on SIGINT or SIGTERM (a front end's serve loop then stops what it started)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
