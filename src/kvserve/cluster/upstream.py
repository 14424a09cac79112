"""The router's HTTP/1.1 client to engines: keep-alive connection pools over asyncio protocols.

Owns the upstream side of the gateway's wire: one pool of idle keep-alive connections per
endpoint, requests written in one ``transport.write``, responses parsed by httptools and
handed over as they arrive (status and headers first; then body pieces, de-chunked), with
read flow control (a connection stops reading while its consumer lags), timeouts for the
connect and for the first byte, and the failure kinds failover needs:

- :class:`UpstreamConnectError`: nothing reached the endpoint (``refused`` says whether the
  endpoint refused: the one failure that proves it down; a timeout may be our own overload);
- :class:`UpstreamDisconnected`: the endpoint closed the connection before answering;
- :class:`UpstreamTimeout`: no response (or no next body piece) in time;
- :class:`UpstreamSaturated`: every connection to the endpoint is busy and its queue is full
  (or a request waited for a connection longer than ``queue_timeout_s``).

Connections per endpoint are bounded (``max_connections``): a request that finds them all
busy waits in a FIFO queue of at most ``max_queue`` requests for the next one released,
so a burst of clients never becomes a burst of connects into an engine's accept backlog.

A kept-alive connection the endpoint closed while it idled is not an error: a request that
gets no byte back on a reused connection is retried once on a fresh one. Idle connections are
dropped after ``idle_timeout_s`` (below uvicorn's default keep-alive of 5 s, so the router
closes them before the engine does).
"""

from __future__ import annotations

import asyncio
import contextlib
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
    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused  # the endpoint refused (nothing listens): it is down


class UpstreamDisconnected(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamSaturated(UpstreamError):
    """No connection to the endpoint free, and no room (or time) left to wait for one."""


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
        self.leased = False  # held by a request (it owns one of the origin's slots)

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
            self.pool._release(self)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()


class _OriginState:
    """One endpoint's connections: idle ones, slots in use, and requests waiting for one."""

    __slots__ = ("idle", "busy", "waiters")

    def __init__(self) -> None:
        self.idle: list[_UpstreamConnection] = []
        self.busy = 0  # slots held by requests (a connection in use or being opened)
        # FIFO of requests waiting for a slot; each gets a connection or None (open one)
        self.waiters: deque[asyncio.Future[_UpstreamConnection | None]] = deque()


class UpstreamPool:
    """Keep-alive connections to every endpoint, shared by all requests of the router.

    ``max_connections`` (per endpoint; ``None``: unbounded) bounds connections open or being
    opened; ``max_queue`` bounds the requests waiting for one, each for at most
    ``queue_timeout_s``.
    """

    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        idle_timeout_s: float = 4.0,
        max_idle_per_origin: int = 64,
        read_buffer_bytes: int = 1 << 20,
        max_connections: int | None = None,
        max_queue: int = 0,
        queue_timeout_s: float = 60.0,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self.read_buffer_bytes = read_buffer_bytes
        self.max_connections = max_connections
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._origins: dict[Origin, _OriginState] = {}
        self._all: set[_UpstreamConnection] = set()
        self._ssl: ssl.SSLContext | None = None

    def busy(self, origin: Origin) -> int:
        """Connections to ``origin`` in use or being opened."""
        st = self._origins.get(origin)
        return st.busy if st is not None else 0

    def queued(self, origin: Origin) -> int:
        """Requests waiting for a connection to ``origin``."""
        st = self._origins.get(origin)
        return len(st.waiters) if st is not None else 0

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
        caller's bookkeeping there is off the request's critical path. Raises
        :class:`UpstreamSaturated` when no connection frees up in time.
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
        conn = await self._acquire(origin)  # holds one of the origin's slots from here on
        for retry in (False, True):
            if conn is None:
                try:
                    conn = await self._connect(origin)
                except BaseException:
                    self._release_slot(origin)
                    raise
                return await self._exchange(conn, data, first_byte_timeout_s, on_sent)
            try:
                return await self._exchange(conn, data, first_byte_timeout_s, on_sent)
            except UpstreamDisconnected:
                if conn._got_bytes or retry:
                    raise
                # A stale kept-alive connection: the endpoint closed it while it idled
                # (its slot went back with it). Again, on a fresh connection.
                on_sent = None  # it ran already
                conn = await self._acquire(origin, fresh=True)
        raise AssertionError("unreachable")

    async def get(
        self,
        origin: Origin,
        path: str,
        *,
        timeout_s: float,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> tuple[int, bytes]:
        """A whole GET exchange within ``timeout_s`` (health checks, scrapes): status, body."""
        async with asyncio.timeout(timeout_s):
            resp = await self.request(
                origin, "GET", path, headers or [], b"", first_byte_timeout_s=None
            )
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
        """A new connection, leased to the caller (who holds a slot for it)."""
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
        except ConnectionRefusedError as e:
            raise UpstreamConnectError(
                f"cannot connect to {origin.host}:{origin.port}: {e}", refused=True
            ) from e
        except OSError as e:
            raise UpstreamConnectError(f"cannot connect to {origin.host}:{origin.port}: {e}") from e
        conn.leased = True
        self._all.add(conn)
        return conn

    # -- slots -----------------------------------------------------------------------------
    def _state(self, origin: Origin) -> _OriginState:
        st = self._origins.get(origin)
        if st is None:
            st = self._origins[origin] = _OriginState()
        return st

    async def _acquire(self, origin: Origin, fresh: bool = False) -> _UpstreamConnection | None:
        """Take a slot: an idle connection (unless ``fresh``), else ``None`` (open one);
        waits in the origin's queue while every slot is busy."""
        st = self._state(origin)
        conn = None if fresh else self._take_idle(st)
        if conn is not None:
            st.busy += 1
            conn.leased = True
            return conn
        cap = self.max_connections
        if fresh and st.idle and cap is not None and st.busy + len(st.idle) >= cap:
            st.idle[0].close()  # room for the fresh one (close() takes it off the list)
        if cap is None or st.busy + len(st.idle) < cap:
            st.busy += 1
            return None
        if len(st.waiters) >= self.max_queue:
            raise UpstreamSaturated(f"{cap} connections busy and {self.max_queue} requests waiting")
        fut: asyncio.Future[_UpstreamConnection | None] = asyncio.get_running_loop().create_future()
        st.waiters.append(fut)
        timer = asyncio.get_running_loop().call_later(
            self.queue_timeout_s,
            _saturate,
            fut,
            f"no connection free after {self.queue_timeout_s} s",
        )
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                handed = fut.result()  # handed over as we were cancelled: pass it on
                if handed is not None:
                    self._release(handed)
                else:
                    self._release_slot(origin)
            raise
        finally:
            timer.cancel()
            if not fut.done() or fut.cancelled() or fut.exception() is not None:
                with contextlib.suppress(ValueError):
                    st.waiters.remove(fut)

    def _release(self, conn: _UpstreamConnection) -> None:
        """A leased connection is free: to the first waiter, else idle."""
        conn.leased = False
        st = self._state(conn.origin)
        while st.waiters:
            w = st.waiters.popleft()
            if not w.done():
                conn.leased = True
                w.set_result(conn)
                return
        st.busy -= 1
        conn.idle_since = time.monotonic()
        if len(st.idle) >= self.max_idle_per_origin:
            conn.close()
            return
        st.idle.append(conn)

    def _release_slot(self, origin: Origin) -> None:
        """A slot without a connection is free: to the first waiter (it connects), else
        back to the count."""
        st = self._state(origin)
        while st.waiters:
            w = st.waiters.popleft()
            if not w.done():
                w.set_result(None)
                return
        st.busy -= 1

    def _take_idle(self, st: _OriginState) -> _UpstreamConnection | None:
        idle = st.idle
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

    def _forget(self, conn: _UpstreamConnection) -> None:
        """``conn`` closed: off the books; a leased one's slot goes to the next waiter."""
        self._all.discard(conn)
        st = self._origins.get(conn.origin)
        if st is None:
            return
        if conn.leased:
            conn.leased = False
            self._release_slot(conn.origin)
        elif conn in st.idle:
            st.idle.remove(conn)

    def prune(self) -> None:
        """Close connections idle longer than ``idle_timeout_s`` (call now and then)."""
        now = time.monotonic()
        for st in self._origins.values():
            for conn in [c for c in st.idle if now - c.idle_since > self.idle_timeout_s]:
                conn.close()

    def close_origin(self, origin: Origin) -> None:
        st = self._origins.get(origin)
        if st is None:
            return
        for conn in list(st.idle):
            conn.close()
        if st.busy == 0 and not st.waiters:
            del self._origins[origin]

    async def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        for st in self._origins.values():
            st.idle.clear()
            for w in st.waiters:
                if not w.done():
                    w.set_exception(UpstreamSaturated("the router is stopping"))
        self._origins.clear()
        await asyncio.sleep(0)  # let the transports' close callbacks run


def _saturate(fut: asyncio.Future, message: str) -> None:
    if not fut.done():
        fut.set_exception(UpstreamSaturated(message))
