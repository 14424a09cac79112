"""The router process: an OpenAI-compatible HTTP gateway in front of many engine servers.

Owns the request path (parse -> tokenize/hash -> schedule -> proxy with failover -> relay)
and the wiring of the parts: endpoint pool, KV index + event subscriber, routing history,
scheduler, metrics. Responses are relayed as they arrive (streams chunk by chunk); a request
is retried on the next-ranked endpoint only while nothing has been sent to the client
(connection failure, timeout before headers, or a 5xx); a client that disconnects cancels
its handler, which closes the upstream connection so the engine aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from yarl import URL

from kvserve.cluster.config import RouterConfig
from kvserve.cluster.endpoints import Endpoint, EndpointPool
from kvserve.cluster.event_subscriber import EventSubscriber
from kvserve.cluster.filters import NoEndpointError
from kvserve.cluster.history import RoutingHistory, SessionTable
from kvserve.cluster.kv_index import KVIndex
from kvserve.cluster.metrics import RouterMetrics
from kvserve.cluster.routing_request import RoutingRequest
from kvserve.cluster.scheduler import Decision, Scheduler
from kvserve.cluster.tokenization import (
    BadRequestError,
    TokenizerRegistry,
    prompt_chars,
    routing_request,
)

logger = logging.getLogger(__name__)

ENDPOINT_HEADER = "x-kvserve-endpoint"  # on every proxied response: who served it
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_KEEP_RESPONSE_HEADERS = ("content-type", "x-request-id", "cache-control")
_INLINE_TOKENS = 4096  # token-id prompts longer than this are hashed on a worker thread
_json_decode = msgspec.json.Decoder().decode


class UpstreamFailed(Exception):
    """An attempt failed before anything reached the client (safe to retry elsewhere)."""

    def __init__(self, kind: str, detail: str, endpoint_down: bool) -> None:
        super().__init__(detail)
        self.kind = kind
        self.endpoint_down = endpoint_down


def _error(status: int, message: str, etype: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": None, "code": status}}
    return web.json_response(body, status=status)


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
        self.subscriber = EventSubscriber(self.index, replay_timeout=config.index.replay_timeout_s)
        self.history = RoutingHistory(config.history_ttl_s, config.history_max_blocks)
        self.sessions = SessionTable(config.session_ttl_s)
        self.history_block_size = config.block_size
        self.scheduler = Scheduler.from_config(config.scheduler, self)
        self.tokenizers = TokenizerRegistry(config.tokenizer, config.tokenizers)
        self.pool = EndpointPool(
            config.endpoints,
            health=config.health,
            endpoints_file=config.endpoints_file,
            file_poll_s=config.endpoints_file_poll_s,
        )
        self.pool.on_added.append(self._endpoint_added)
        self.pool.on_removed.append(self._endpoint_removed)
        self.metrics = RouterMetrics(lambda: (self.pool, self.index, self.subscriber))
        self._session: aiohttp.ClientSession | None = None
        self._upstream_timeout = aiohttp.ClientTimeout(
            total=None, connect=config.connect_timeout_s, sock_read=config.first_byte_timeout_s
        )
        self._urls: dict[tuple[str, str], URL] = {}
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------ lifecycle

    def _endpoint_added(self, ep: Endpoint) -> None:
        if ep.spec.kv_events:
            self.subscriber.add_endpoint(
                ep.name, ep.spec.kv_events, ep.spec.kv_events_replay, ep.spec.kv_events_topic
            )

    def _endpoint_removed(self, ep: Endpoint) -> None:
        self.subscriber.remove_endpoint(ep.name)  # also drops it from the index
        self.index.remove_endpoint(ep.name)
        self.history.forget(ep.name)
        self.sessions.forget_endpoint(ep.name)

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/router/state", self.state)
        return app

    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Start everything and listen; returns the bound port (``port=0``: a free one)."""
        self.subscriber.start()
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        await self.pool.start(self._session)
        self._runner = web.AppRunner(self.make_app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.config.host if host is None else host,
            self.config.port if port is None else port,
            reuse_address=True,
        )
        await site.start()
        sockets = site._server.sockets if site._server is not None else []  # noqa: SLF001
        self.port = sockets[0].getsockname()[1] if sockets else port
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.pool.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.subscriber.close()

    # ------------------------------------------------------------------ small handlers

    async def models(self, request: web.Request) -> web.Response:
        cards: dict[str, dict] = {}
        for ep in self.pool.healthy():
            for card in ep.model_cards or [{"id": m, "object": "model"} for m in ep.models]:
                cards.setdefault(str(card["id"]), card)
            for m in ep.models:
                cards.setdefault(m, {"id": m, "object": "model", "owned_by": "kvserve"})
        return web.json_response({"object": "list", "data": list(cards.values())})

    async def health(self, request: web.Request) -> web.Response:
        n = len(self.pool.healthy())
        return web.json_response(
            {"status": "ok" if n else "unavailable", "healthy_endpoints": n},
            status=200 if n else 503,
        )

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def state(self, request: web.Request) -> web.Response:
        streams = self.subscriber.all_stats()
        eps = []
        for ep in self.pool.endpoints.values():
            st = streams.get(ep.name)
            eps.append(
                {
                    "name": ep.name,
                    "url": ep.url,
                    "models": list(ep.models),
                    "healthy": ep.healthy,
                    "last_error": ep.last_error,
                    "in_flight": ep.in_flight,
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
        return web.json_response({"endpoints": eps, "kv_index_blocks": self.index.num_blocks})

    # ------------------------------------------------------------------ proxy

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=True)

    async def _routing_request(
        self, body: dict[str, Any], chat: bool, session_id: str | None
    ) -> RoutingRequest:
        def build() -> RoutingRequest:
            req = routing_request(
                body,
                chat,
                self.tokenizers,
                session_id=session_id,
                seed=self.config.prefix_hash_seed,
            )
            if req.token_ids is not None and len(req.token_ids) > _INLINE_TOKENS:
                for bs in {self.index.endpoint_block_size(n) for n in self.pool.endpoints}:
                    if bs:
                        req.block_keys(bs)  # hash here, off the event loop
            return req

        prompt = body.get("prompt")
        long_ids = isinstance(prompt, list) and len(prompt) > _INLINE_TOKENS
        if prompt_chars(body, chat) > self.config.inline_tokenize_chars or long_ids:
            return await asyncio.get_running_loop().run_in_executor(None, build)
        return build()

    async def _proxy(self, request: web.Request, chat: bool) -> web.StreamResponse:
        t0 = time.perf_counter()
        raw = await request.read()
        try:
            body = _json_decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError):
            self.metrics.rejected_of(400).inc()
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            self.metrics.rejected_of(400).inc()
            return _error(400, "request body must be a JSON object")
        session_id = request.headers.get(self.config.session_header)
        try:
            req = await self._routing_request(body, chat, session_id)
            decision = self.scheduler.schedule(req, list(self.pool.endpoints.values()))
        except BadRequestError as e:
            self.metrics.rejected_of(400).inc()
            return _error(400, str(e))
        except NoEndpointError as e:
            self.metrics.rejected_of(e.status).inc()
            kind = "not_found_error" if e.status == 404 else "service_unavailable"
            return _error(e.status, e.message, kind)
        self.metrics.routing_time.observe(time.perf_counter() - t0)
        return await self._forward(request, raw, req, decision)

    async def _forward(
        self, request: web.Request, raw: bytes, req: RoutingRequest, decision: Decision
    ) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        attempts = decision.ranked[: self.config.max_attempts]
        last_error = "no endpoint tried"
        for i, ep in enumerate(attempts):
            if i > 0 and not ep.healthy:
                continue
            ep.in_flight += 1
            try:
                t_send = time.perf_counter()
                try:
                    upstream = await self._send(
                        ep, request.path, raw, headers, last=i == len(attempts) - 1
                    )
                except UpstreamFailed as e:
                    last_error = f"{ep.name}: {e}"
                    self.metrics.failovers_of(ep.name, e.kind).inc()
                    if e.endpoint_down:
                        self.pool.mark_failed(ep, str(e))
                    logger.info("attempt %d on %s failed (%s); failing over", i + 1, ep.name, e)
                    continue
                ep.answered_at = time.monotonic()
                metrics = self.metrics
                metrics.first_byte_of(ep.name).observe(time.perf_counter() - t_send)
                metrics.decisions_of(decision.reason if i == 0 else "failover").inc()
                self.scheduler.observe(req, ep)
                try:
                    return await self._relay(request, upstream, ep)
                finally:
                    metrics.latency_of(ep.name).observe(time.perf_counter() - t_send)
                    metrics.requests_of(ep.name, upstream.status).inc()
            finally:
                ep.in_flight -= 1
        self.metrics.rejected_of(502).inc()
        return _error(502, f"all endpoints failed ({last_error})", "bad_gateway")

    def _upstream_url(self, base: str, path: str) -> URL:
        """The parsed URL of ``path`` on an endpoint (parsing a URL per request is costly)."""
        url = self._urls.get((base, path))
        if url is None:
            if len(self._urls) > 4096:  # endpoints come and go; never grow without bound
                self._urls.clear()
            url = self._urls[(base, path)] = URL(base + path)
        return url

    async def _send(
        self, ep: Endpoint, path: str, raw: bytes, headers: dict[str, str], last: bool
    ) -> aiohttp.ClientResponse:
        assert self._session is not None
        try:
            upstream = await self._session.post(
                self._upstream_url(ep.url, path),
                data=raw,
                headers=headers,
                timeout=self._upstream_timeout,
                allow_redirects=False,
            )
        except aiohttp.ClientConnectorError as e:
            raise UpstreamFailed("connect", str(e), endpoint_down=True) from None
        except TimeoutError:
            raise UpstreamFailed("timeout", "no response headers in time", False) from None
        except (aiohttp.ClientError, OSError) as e:
            # e.g. the server closed a kept-alive connection or died mid-request.
            raise UpstreamFailed("disconnect", f"{type(e).__name__}: {e}", True) from None
        if upstream.status >= 500 and not last:
            upstream.release()
            raise UpstreamFailed(f"http_{upstream.status}", f"HTTP {upstream.status}", False)
        return upstream

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, ep: Endpoint
    ) -> web.StreamResponse:
        out_headers = {
            k: upstream.headers[k] for k in _KEEP_RESPONSE_HEADERS if k in upstream.headers
        }
        out_headers[ENDPOINT_HEADER] = ep.name
        done = False
        resp: web.StreamResponse | None = None
        try:
            ctype = upstream.headers.get("content-type", "")
            if upstream.content_length is not None and not ctype.startswith("text/event-stream"):
                data = await upstream.read()
                done = True
                return web.Response(body=data, status=upstream.status, headers=out_headers)
            resp = web.StreamResponse(status=upstream.status, headers=out_headers)
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            done = True
            return resp
        except (TimeoutError, aiohttp.ClientError) as e:
            # The endpoint failed after answering: too late to retry elsewhere.
            logger.warning("upstream %s failed mid-response: %s", ep.name, e)
            if resp is None:
                return _error(502, f"{ep.name} failed mid-response: {e}", "bad_gateway")
            if request.transport is not None:
                request.transport.close()  # the client sees a truncated stream, not success
            return resp
        finally:
            if done:
                upstream.release()
            else:
                # Client gone (handler cancelled) or write failed: close the upstream
                # connection so the engine sees the disconnect and aborts the request.
                upstream.close()


async def serve_forever(router: Router) -> None:
    await router.start()
    logger.warning("kvserve route listening on http://%s:%s", router.config.host, router.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await router.stop()
