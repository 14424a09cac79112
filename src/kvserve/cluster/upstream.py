"""The router's HTTP/1.1 client to engines: keep-alive connection pools over asyncio protocols.

Owns the upstream side of the gateway's wire: one pool of idle keep-alive connections per
endpoint, requests written in one ``transport.write``, responses parsed by httptools and
handed over as they arrive (status and headers first; then body pieces, de-chunked), with
read flow control (a connection stops reading while its consumer lags), timeouts for the
connect and for the first byte, and the failure kinds failover needs:

- :class:`UpstreamConnectError`: nothing reached the endpoint (refused, unreachable, timeout);
- :class:`UpstreamDisconnected`: the endpoint closed the connection before answering;
- :class:`UpstreamTimeout`: no response (or no next body piece) in time.

A kept-alive connection the endpoint closed while it idled is not an error: a request that
gets no byte back on a reused connection is retried once on a fresh one. Idle connections are
dropped after ``idle_timeout_s`` (below uvicorn's default keep-alive of 5 s, so the router
closes them before the engine does).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools


class UpstreamError(Exception):
    """Base of the failures of one upstream attempt."""


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamDisconnected(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


@dataclass(frozen=True)
class Origin:
    """Where an endpoint listens: parsed once from its URL."""

    host: str
    port: int
    tls: bool
    base_path: str  # prefix of every request path ("" for most engines)
    host_header: str

    @classmethod
    def from_url(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint URL must be http(s)://host[:port][/path], got {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        return cls(parts.hostname, port, tls, parts.path.rstrip("/"), parts.netloc)


def _expire(fut: asyncio.Future, message: str) -> None:
    if not fut.done():
        fut.set_exception(UpstreamTimeout(message))


async def _wait(fut: asyncio.Future, timeout: float | None, message: str):
    """``await fut``, failed with :class:`UpstreamTimeout` after ``timeout`` seconds.

    One timer handle on the loop: cheaper per request than an ``asyncio.timeout`` scope.
    """
    if timeout is None:
        return await fut
    timer = asyncio.get_running_loop().call_later(timeout, _expire, fut, message)
    try:
        return await fut
    finally:
        timer.cancel()


class UpstreamResponse:
    """A response being received: ``status``/``headers`` are set; the body arrives in pieces."""

    def __init__(self, conn: _UpstreamConnection, status: int, headers: list[tuple[bytes, bytes]]):
        self._conn = conn
        self.status = status
        self.headers = headers
        self.content_length: int | None = None
        self.content_type = ""
        self.chunked = False
        for k, v in headers:
            lk = k.lower()
            if lk == b"content-length" and v.isdigit():
                self.content_length = int(v)
            elif lk == b"content-type":
                self.content_type = v.decode("latin-1")
            elif lk == b"transfer-encoding" and b"chunked" in v.lower():
                self.chunked = True
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self.complete = False
        self._error: BaseException | None = None

    # -- fed by the connection --------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._pieces.append(data)
        self._buffered += len(data)
        if self._buffered > self._conn.pool.read_buffer_bytes:
            self._conn.pause_reading()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if error is None:
            self.complete = True
        elif not self.complete and self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- consumed by the gateway ------------------------------------------------------------
    def take_buffered(self) -> bytes:
        """All body bytes received so far (the whole body once :attr:`complete`)."""
        data = b"".join(self._pieces)
        self._pieces.clear()
        self._buffered = 0
        self._conn.resume_reading()
        return data

    async def next_piece(self, timeout: float | None) -> bytes | None:
        """The next body bytes as they arrive; ``None`` at the end of the body."""
        while not self._pieces:
            if self.complete:
                return None
            if self._error is not None:
                raise self._error
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            try:
                await _wait(waiter, timeout, f"no data for {timeout} s")
            finally:
                self._waiter = None
        return self.take_buffered()

    async def read(self, timeout: float | None) -> bytes:
        parts = []
        while (piece := await self.next_piece(timeout)) is not None:
            parts.append(piece)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the response: the connection goes back to its pool (or is closed when the
        body was not read to the end or the endpoint asked to close)."""
        self._conn.finished_with(self)

    def close(self) -> None:
        """Abandon the response: close the connection (the endpoint sees the disconnect)."""
        self._conn.close()


class _UpstreamConnection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.keep_alive = True
        self._headers: list[tuple[bytes, bytes]] = []
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self.response: UpstreamResponse | None = None
        self._got_bytes = False
        self._reading_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        err = UpstreamDisconnected(f"connection closed: {exc}" if exc else "connection closed")
        if self._head is not None and not self._head.done():
            self._head.set_exception(err)
        resp = self.response
        if resp is not None:
            if resp.content_length is None and not resp.chunked:
                resp._finish()  # a body delimited by the end of the connection
            else:
                resp._finish(err)

    def data_received(self, data: bytes) -> None:
        if self._head is None:
            self.close()  # bytes nobody asked for: the connection is out of step
            return
        self._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            err = UpstreamDisconnected(f"malformed HTTP response: {e}")
            if self._head is not None and not self._head.done():
                self._head.set_exception(err)
            if self.response is not None:
                self.response._finish(err)
            self.close()

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim response (100 Continue): the real one follows
        self.keep_alive = self.parser.should_keep_alive()
        self.response = UpstreamResponse(self, status, self._headers)
        if self._head is not None and not self._head.done():
            self._head.set_result(self.response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response._finish()

    # -- request / lifecycle ----------------------------------------------------------------
    def send(self, data: bytes) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        self._head = asyncio.get_running_loop().create_future()
        self._got_bytes = False
        self.response = None
        self.transport.write(data)
        return self._head

    def finished_with(self, response: UpstreamResponse) -> None:
        if response.complete and self.keep_alive and not self.closed:
            self.response = None
            self._head = None
            self.resume_reading()
            self.pool._put_idle(self)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()


class UpstreamPool:
    """Keep-alive connections to every endpoint, shared by all requests of the router."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        idle_timeout_s: float = 4.0,
        max_idle_per_origin: int = 64,
        read_buffer_bytes: int = 1 << 20,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self.read_buffer_bytes = read_buffer_bytes
        self._idle: dict[Origin, list[_UpstreamConnection]] = {}
        self._all: set[_UpstreamConnection] = set()
        self._ssl: ssl.SSLContext | None = None

    async def request(
        self,
        origin: Origin,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        first_byte_timeout_s: float | None,
        on_sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send a request; returns once the response's status and headers are in.

        ``on_sent`` runs once the request is written, while the endpoint works on it: the
        caller's bookkeeping there is off the request's critical path.
        """
        data = b"%s %s%s HTTP/1.1\r\nhost: %s\r\n%bcontent-length: %d\r\n\r\n%b" % (
            method.encode(),
            origin.base_path.encode(),
            path.encode("latin-1"),
            origin.host_header.encode(),
            b"".join([b"%b: %b\r\n" % kv for kv in headers]),
            len(body),
            body,
        )
        conn = self._take_idle(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, data, first_byte_timeout_s, on_sent)
            except UpstreamDisconnected:
                if conn._got_bytes:
                    raise
                # A stale kept-alive connection: the endpoint closed it while it idled.
                on_sent = None  # it ran already
        conn = await self._connect(origin)
        return await self._exchange(conn, data, first_byte_timeout_s, on_sent)

    async def get(self, origin: Origin, path: str, *, timeout_s: float) -> tuple[int, bytes]:
        """A whole GET exchange within ``timeout_s`` (health checks, scrapes): status, body."""
        async with asyncio.timeout(timeout_s):
            resp = await self.request(origin, "GET", path, [], b"", first_byte_timeout_s=None)
            try:
                body = await resp.read(None)
            except BaseException:
                resp.close()
                raise
            resp.release()
            return resp.status, body

    async def _exchange(
        self,
        conn: _UpstreamConnection,
        data: bytes,
        timeout: float | None,
        on_sent: Callable[[], None] | None,
    ) -> UpstreamResponse:
        head = conn.send(data)
        if on_sent is not None:
            on_sent()
        try:
            return await _wait(head, timeout, "no response headers in time")
        except BaseException:
            conn.close()  # cancelled (client gone) or failed: the endpoint must see it
            raise

    async def _connect(self, origin: Origin) -> _UpstreamConnection:
        loop = asyncio.get_running_loop()
        ssl_ctx = None
        if origin.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_ctx = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _UpstreamConnection(self, origin), origin.host, origin.port, ssl=ssl_ctx
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"connect to {origin.host}:{origin.port} timed out"
            ) from None
        except OSError as e:
            raise UpstreamConnectError(f"cannot connect to {origin.host}:{origin.port}: {e}") from e
        self._all.add(conn)
        return conn

    def _take_idle(self, origin: Origin) -> _UpstreamConnection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # most recently used first: its peer is least likely to drop it
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self.idle_timeout_s:
                conn.close()
                continue
            return conn
        return None

    def _put_idle(self, conn: _UpstreamConnection) -> None:
        idle = self._idle.setdefault(conn.origin, [])
        conn.idle_since = time.monotonic()
        if len(idle) >= self.max_idle_per_origin:
            conn.close()
            return
        idle.append(conn)

    def _forget(self, conn: _UpstreamConnection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    def prune(self) -> None:
        """Close connections idle longer than ``idle_timeout_s`` (call now and then)."""
        now = time.monotonic()
        for idle in self._idle.values():
            for conn in [c for c in idle if now - c.idle_since > self.idle_timeout_s]:
                conn.close()

    def close_origin(self, origin: Origin) -> None:
        for conn in list(self._idle.pop(origin, [])):
            conn.close()

    async def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' close callbacks run
