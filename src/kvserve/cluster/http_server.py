"""The router's HTTP/1.1 server: asyncio protocols with httptools' parser, no framework.

Owns the client side of the gateway's wire: parsing requests (httptools, the C parser
uvicorn uses), keep-alive and pipelining (requests on one connection are handled in order),
``Expect: 100-continue``, a body size limit, write flow control, and cancelling a request's
handler when its client goes away (so the proxied engine request is aborted too).

Slow clients cannot hold a connection: a request's line and headers must arrive within
``header_timeout_s`` (of the connection, or of the request's first byte on a kept-alive
one), its body within ``body_timeout_s`` of its headers (else 408, then close); a
kept-alive connection idle for ``keep_alive_timeout_s`` is closed. One sweep per fraction of
a second checks every connection: the request path only stores a deadline.

Protocol upgrades are not served: a request asking for one (``Upgrade: h2c`` from
``curl --http2``) is answered as the HTTP/1.1 request it also is (llhttp stops at such a
head and would take its body for the new protocol: the head is parsed again without the
upgrade headers, and the body after it).

A request costs one ``data_received`` and, for a buffered answer, one ``transport.write``:
the router's added latency is its CPU per request, and a general-purpose framework's request
and response objects cost more than the routing itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

import httptools

logger = logging.getLogger(__name__)

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
MAX_HEAD_BYTES = 64 << 10  # request line + headers
# Headers that ask for (or configure) a protocol upgrade: dropped when a head is re-parsed.
_UPGRADE_HEADERS = frozenset({b"upgrade", b"http2-settings", b"connection"})


@dataclass
class HttpRequest:
    method: str
    path: str  # without the query string
    query: str
    headers: list[tuple[bytes, bytes]]  # as received (names in their original case)
    body: bytes
    keep_alive: bool

    def header(self, name: bytes) -> str | None:
        """A header's value by lower-case name (the last one when repeated)."""
        found = None
        for k, v in self.headers:
            if k.lower() == name:
                found = v
        return None if found is None else found.decode("latin-1")


Handler = Callable[[HttpRequest, "HttpResponse"], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


class ClientGone(ConnectionError):
    """The client closed its connection while its response was being written."""


class HttpResponse:
    """One response on a connection: either buffered (``send``) or streamed (``start``,
    ``write``..., ``end``; chunked unless a content length is given)."""

    __slots__ = ("_conn", "started", "finished", "status", "_chunked")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.started = False
        self.finished = False
        self.status = 0
        self._chunked = False

    def _head(self, status: int, headers: list[tuple[str, str]], length: int | None) -> bytearray:
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        out = bytearray(b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown")))
        for k, v in headers:
            out += b"%b: %b\r\n" % (k, v)
        if length is None:
            self._chunked = True
            out += b"transfer-encoding: chunked\r\n"
        else:
            out += b"content-length: %d\r\n" % length
        if not self._conn.keep_alive:
            out += b"connection: close\r\n"
        out += b"\r\n"
        return out

    def send(self, status: int, headers: Headers, body: bytes) -> None:
        """The whole response in one write."""
        out = self._head(status, headers, len(body))
        out += body
        self._conn.write(bytes(out))
        self.finished = True

    def start(self, status: int, headers: Headers, length: int | None = None) -> None:
        self._conn.write(bytes(self._head(status, headers, length)))

    async def write(self, data: bytes) -> None:
        """Write a piece of the body; waits while the client is not reading (flow control)."""
        if not data:
            return
        if self._chunked:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._conn.write(data)
        await self._conn.drain()

    def abort(self) -> None:
        """Cut the connection mid-response (the client must not take it as complete)."""
        self._conn.keep_alive = False
        self.finished = True
        if self._conn.transport is not None:
            self._conn.transport.close()

    def end(self) -> None:
        if self.finished:
            return
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
        self.finished = True


class _Connection(asyncio.Protocol):
    """One client connection: parse, queue, handle in order, respond."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.keep_alive = True
        self._queue: deque[HttpRequest] = deque()
        self._task: asyncio.Task | None = None
        self._paused: asyncio.Future | None = None
        self._closed = False
        # the request being parsed
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_len = 0
        self._head_len = 0
        self._rejected = False
        self._in_message = False  # bytes of a request not yet complete were parsed
        self._upgrade = False  # the request being parsed asks for a protocol upgrade
        # Slow-client timeouts (checked by the server's sweep while no handler runs): close
        # at ``_deadline`` (0: none), answering 408 if ``_deadline_408`` (a request begun).
        self._deadline = time.monotonic() + server.header_timeout_s
        self._deadline_408 = False
        self._fresh = True  # no request completed yet

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.server._connections.discard(self)
        self._queue.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client went away: stop its request (and the upstream's)
        if self._paused is not None and not self._paused.done():
            self._paused.set_exception(ClientGone())

    def data_received(self, data: bytes) -> None:
        try:
            while True:
                try:
                    self.parser.feed_data(data)
                    return
                except httptools.HttpParserUpgrade as e:
                    # Serve it as HTTP/1.1: parse its head again without the upgrade headers,
                    # then what followed the head (its body, the next requests).
                    offset = e.args[0] if e.args else len(data)
                    head = self._head_without_upgrade()
                    if head is None:
                        self._fail(400, "protocol upgrades and CONNECT are not supported")
                        return
                    data = head + data[offset:]
                    self.parser = httptools.HttpRequestParser(self)
        except httptools.HttpParserError as e:
            if not self._rejected:
                self._fail(400, f"malformed HTTP request: {e}")

    def _head_without_upgrade(self) -> bytes | None:
        """The head of the request that asked for an upgrade, without the upgrade's headers
        (``None`` for CONNECT, or when there is no such request)."""
        if not self._upgrade or self._rejected:
            return None
        self._upgrade = False
        method = self.parser.get_method()
        if method == b"CONNECT":
            return None
        version = self.parser.get_http_version().encode()
        out = bytearray(b"%b %b HTTP/%b\r\n" % (method, self._url, version))
        for k, v in self._headers:
            lk = k.lower()
            if lk == b"connection":
                if b"close" in v.lower():
                    out += b"connection: close\r\n"
            elif lk not in _UPGRADE_HEADERS:
                out += b"%b: %b\r\n" % (k, v)
        out += b"\r\n"
        return bytes(out)

    def pause_writing(self) -> None:
        if self._paused is None or self._paused.done():
            self._paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._body_len = 0
        self._head_len = 0
        self._in_message = True
        if not self._deadline_408:  # the first byte of a request: its head must follow
            if not self._fresh or not self._deadline:  # (a new connection's runs from connect)
                self._deadline = time.monotonic() + self.server.header_timeout_s
            self._deadline_408 = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        self._count_head(len(name) + len(value))

    def _count_head(self, n: int) -> None:
        self._head_len += n
        if self._head_len > MAX_HEAD_BYTES and not self._rejected:
            self._fail(431, f"request line and headers over {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self._deadline = time.monotonic() + self.server.body_timeout_s
        if self.parser.should_upgrade():
            self._upgrade = True  # served as HTTP/1.1 (data_received parses it again)
            return
        limit = self.server.max_body_bytes
        for k, v in self._headers:
            lk = k.lower()
            if lk == b"content-length" and v.isdigit() and int(v) > limit:
                self._fail(413, f"request body over the limit of {limit} bytes")
                return
            if lk == b"expect" and v.lower() == b"100-continue":
                self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self.server.max_body_bytes:
            self._fail(413, f"request body over the limit of {self.server.max_body_bytes} bytes")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        self._fresh = False
        self._deadline = 0.0
        self._deadline_408 = False
        if self._rejected or self._upgrade:
            return
        url = self._url
        path, _, query = url.partition(b"?")
        req = HttpRequest(
            method=self.parser.get_method().decode("latin-1"),
            path=path.decode("latin-1"),
            query=query.decode("latin-1"),
            headers=self._headers,
            body=b"".join(self._body) if len(self._body) != 1 else self._body[0],
            keep_alive=self.parser.should_keep_alive(),
        )
        self._body = []  # the request owns it now (a connection outlives its requests)
        self._queue.append(req)
        if self._task is None:
            self._next()

    # -- handling --------------------------------------------------------------------------
    def _next(self) -> None:
        if not self._queue or self._closed:
            self._task = None
            if self._in_message:  # a pipelined request has begun: its rest must follow
                self._deadline = time.monotonic() + self.server.header_timeout_s
                self._deadline_408 = True
            else:
                self._deadline = time.monotonic() + self.server.keep_alive_timeout_s
            return
        req = self._queue.popleft()
        self._task = asyncio.get_running_loop().create_task(self._handle(req))

    async def _handle(self, req: HttpRequest) -> None:
        resp = HttpResponse(self)
        if not req.keep_alive:
            self.keep_alive = False
        try:
            await self.server.handler(req, resp)
        except (asyncio.CancelledError, ClientGone):
            if self._closed:
                return  # the client is gone; nothing to answer
            raise
        except Exception:
            logger.exception("unhandled error serving %s %s", req.method, req.path)
            if not resp.started:
                resp.send(*self.server.error_response(500, "internal router error"))
            else:
                resp.abort()  # cut, not ended: the client must not take it as complete
        if not resp.finished and not self._closed:
            if not resp.started:
                resp.send(*self.server.error_response(500, "no response"))
            else:
                resp.end()
        if not self.keep_alive and self.transport is not None:
            self.transport.close()
            self._closed = True
        self._next()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self._closed:
            self.transport.write(data)

    async def drain(self) -> None:
        if self._closed:
            raise ClientGone()
        if self._paused is not None and not self._paused.done():
            await self._paused

    def _expire(self) -> None:
        """Its deadline passed while no handler ran: 408 for a request begun, else close."""
        if self._deadline_408:
            self._fail(408, "request not received in time")
        elif self.transport is not None:
            self.transport.close()
            self._closed = True

    def _fail(self, status: int, message: str) -> None:
        """Answer a request that cannot be parsed or accepted, then close the connection."""
        self._rejected = True
        self.keep_alive = False
        if self._task is None and self.transport is not None and not self._closed:
            status_, headers, body = self.server.error_response(status, message)
            HttpResponse(self).send(status_, headers, body)
            self.transport.close()
            self._closed = True
        elif self.transport is not None:
            self.transport.close()


class HttpServer:
    """Serve ``handler`` on a TCP socket; ``error_response`` shapes parse-level errors."""

    def __init__(
        self,
        handler: Handler,
        error_response: Callable[[int, str], tuple[int, Headers, bytes]],
        *,
        max_body_bytes: int = 64 << 20,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 60.0,
        keep_alive_timeout_s: float = 30.0,
        backlog: int = 4096,
    ) -> None:
        self.handler = handler
        self.error_response = error_response
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.keep_alive_timeout_s = keep_alive_timeout_s
        self.backlog = backlog
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (``port=0``: a free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, backlog=self.backlog
        )
        self._sweeper = loop.create_task(self._sweep())
        return self._server.sockets[0].getsockname()[1]

    async def _sweep(self) -> None:
        """Close connections whose client is too slow (see the module doc)."""
        shortest = min(self.header_timeout_s, self.body_timeout_s, self.keep_alive_timeout_s)
        period = min(max(shortest / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self._connections):
                if conn._task is None and 0 < conn._deadline <= now and not conn._closed:
                    conn._expire()

    async def close(self) -> None:
        if self._server is None:
            return
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._server.close()
        tasks = []
        for conn in list(self._connections):
            if conn._task is not None:
                tasks.append(conn._task)
            if conn.transport is not None:
                conn.transport.close()
        for t in tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
