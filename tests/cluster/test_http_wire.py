"""The router's own HTTP/1.1 wire on real sockets: the server side (pipelining, 100-continue,
limits, malformed input, disconnects) and the upstream pools (keep-alive reuse, stale
connections, timeouts, streamed and close-delimited bodies)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvserve.cluster.gateway import error_reply
from kvserve.cluster.http_server import HttpRequest, HttpResponse, HttpServer
from kvserve.cluster.upstream import (
    Origin,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamPool,
    UpstreamSaturated,
    UpstreamTimeout,
)


def arun(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), 30))


async def raw_exchange(port: int, data: bytes, until: bytes, n: int = 1) -> bytes:
    """Send raw bytes; read until ``until`` was seen ``n`` times (or EOF)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = b""
    while out.count(until) < n:
        chunk = await asyncio.wait_for(reader.read(65536), 5)
        if not chunk:
            break
        out += chunk
    writer.close()
    return out


# ------------------------------------------------------------------------------ server side


async def echo(req: HttpRequest, resp: HttpResponse) -> None:
    if req.path == "/stream":
        resp.start(200, [(b"content-type", b"text/event-stream")])
        for i in range(3):
            await resp.write(b"data: %d\n\n" % i)
        resp.end()
        return
    body = b"%s %s q=%s len=%d x=%s" % (
        req.method.encode(),
        req.path.encode(),
        req.query.encode(),
        len(req.body),
        (req.header(b"x-test") or "").encode(),
    )
    resp.send(200, [(b"content-type", b"text/plain")], body)


def test_server_keep_alive_pipelining_and_chunked_streams() -> None:
    async def main() -> None:
        server = HttpServer(echo, error_reply)
        port = await server.start("127.0.0.1", 0)
        try:
            two = (
                b"POST /a?x=1 HTTP/1.1\r\nhost: h\r\nX-Test: t1\r\ncontent-length: 3\r\n\r\nabc"
                b"GET /b HTTP/1.1\r\nhost: h\r\n\r\n"
            )
            out = await raw_exchange(port, two, b"HTTP/1.1 200", n=2)
            first, second = out.split(b"HTTP/1.1 200 OK")[1:]
            assert first.endswith(b"POST /a q=x=1 len=3 x=t1")  # answered in order
            assert second.endswith(b"GET /b q= len=0 x=")
            # A streamed response is chunk-encoded and terminated.
            out = await raw_exchange(port, b"GET /stream HTTP/1.1\r\nhost: h\r\n\r\n", b"0\r\n\r\n")
            assert b"transfer-encoding: chunked" in out
            assert out.endswith(b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n")
            # A chunked request body is reassembled.
            body = b"POST /c HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n"
            body += b"2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"
            assert (await raw_exchange(port, body, b"len=5")).endswith(b"len=5 x=")
            # Connection: close is honoured.
            out = await raw_exchange(
                port, b"GET /d HTTP/1.0\r\n\r\n", b"never", n=1
            )  # read to EOF: the server closes
            assert b"connection: close" in out and out.endswith(b"len=0 x=")
        finally:
            await server.close()

    arun(main)


def test_server_expect_continue_limits_and_malformed_input() -> None:
    async def main() -> None:
        server = HttpServer(echo, error_reply, max_body_bytes=100)
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /e HTTP/1.1\r\nhost: h\r\nexpect: 100-continue\r\ncontent-length: 4\r\n\r\n"
            )
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"wxyz")
            head = await asyncio.wait_for(reader.readuntil(b"len=4 x="), 5)
            assert head.startswith(b"HTTP/1.1 200 OK")
            writer.close()
            # Over the body limit: 413 with an OpenAI-style error, connection closed.
            out = await raw_exchange(
                port, b"POST /f HTTP/1.1\r\nhost: h\r\ncontent-length: 101\r\n\r\n", b"never"
            )
            assert out.startswith(b"HTTP/1.1 413") and b'"error"' in out
            # Endless headers: 431, closed.
            junk = b"GET / HTTP/1.1\r\n" + b"x-junk: " + b"j" * (70 << 10) + b"\r\n\r\n"
            out = await raw_exchange(port, junk, b"never")
            assert out.startswith(b"HTTP/1.1 431")
            # Not HTTP at all: 400, closed.
            out = await raw_exchange(port, b"\x16\x03\x01 hello\r\n\r\n", b"never")
            assert out.startswith(b"HTTP/1.1 400") and b"malformed" in out
        finally:
            await server.close()

    arun(main)


def test_server_cancels_the_handler_when_the_client_goes_away() -> None:
    async def main() -> None:
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def slow(req: HttpRequest, resp: HttpResponse) -> None:
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        server = HttpServer(slow, error_reply)
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nhost: h\r\n\r\n")
            await asyncio.wait_for(started.wait(), 5)
            writer.close()
            await asyncio.wait_for(cancelled.wait(), 5)
        finally:
            await server.close()

    arun(main)


def test_server_answers_500_when_the_handler_fails() -> None:
    async def main() -> None:
        async def broken(req: HttpRequest, resp: HttpResponse) -> None:
            if req.path == "/mid-stream":
                resp.start(200, [(b"content-type", b"text/event-stream")])
                await resp.write(b"data: 1\n\n")
            raise RuntimeError("bug")

        server = HttpServer(broken, error_reply)
        port = await server.start("127.0.0.1", 0)
        try:
            out = await raw_exchange(port, b"GET / HTTP/1.1\r\nhost: h\r\n\r\n", b"}}")
            assert out.startswith(b"HTTP/1.1 500") and b"internal router error" in out
            # Failing mid-stream: the stream is cut (no last chunk), never ended as if whole.
            out = await raw_exchange(port, b"GET /mid-stream HTTP/1.1\r\nhost: h\r\n\r\n", b"!")
            assert out.endswith(b"data: 1\n\n\r\n") and b"0\r\n\r\n" not in out
        finally:
            await server.close()

    arun(main)


# ------------------------------------------------------------------------------ upstream side


class RawBackend:
    """A TCP server answering each request with a scripted behaviour; counts connections."""

    def __init__(self, behaviour: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]):
        self.behaviour = behaviour
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> Origin:
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.behaviour(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return Origin.from_url(f"http://127.0.0.1:{port}")

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def test_upstream_reuses_connections_and_retries_a_stale_one() -> None:
    async def main() -> None:
        async def two_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            for _ in range(2):  # serve two requests, then drop the idle connection
                req = await read_request(reader)
                body = b"ok:" + req.split(b"\r\n\r\n", 1)[1]
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
                await writer.drain()

        backend = RawBackend(two_then_close)
        origin = await backend.start()
        pool = UpstreamPool()
        try:
            for i in range(5):
                resp = await pool.request(
                    origin, "POST", "/x", [(b"x-a", b"1")], b"b%d" % i, first_byte_timeout_s=5
                )
                assert resp.status == 200 and await resp.read(5) == b"ok:b%d" % i
                resp.release()
                await asyncio.sleep(0.05)  # let the backend's close land on every 2nd
            # Two requests per connection; the stale one was retried without an error.
            assert backend.connections == 3
        finally:
            await pool.close()
            await backend.stop()

    arun(main)


def test_upstream_timeouts_errors_and_bodies() -> None:
    async def main() -> None:
        async def behaviour(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            req = await read_request(reader)
            path = req.split(b" ")[1]
            if path == b"/silent":
                await asyncio.sleep(10)
            elif path == b"/hangup":
                return
            elif path == b"/chunked":
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n")
                await writer.drain()
                await asyncio.sleep(0.2)
                writer.write(b"3\r\ntwo\r\n0\r\n\r\n")
            elif path == b"/until-close":
                writer.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")
            elif path == b"/garbage":
                writer.write(b"NOT HTTP\r\n\r\n")
            await writer.drain()

        backend = RawBackend(behaviour)
        origin = await backend.start()
        pool = UpstreamPool(connect_timeout_s=1)

        async def req(path: str, timeout: float | None = 5):
            return await pool.request(origin, "GET", path, [], b"", first_byte_timeout_s=timeout)

        try:
            with pytest.raises(UpstreamTimeout):
                await req("/silent", timeout=0.2)
            with pytest.raises(UpstreamDisconnected):
                await req("/hangup")
            with pytest.raises(UpstreamDisconnected):
                await req("/garbage")
            resp = await req("/chunked")
            assert await resp.next_piece(5) == b"one"  # the first piece, before the rest exists
            assert not resp.complete
            assert await resp.next_piece(5) == b"two" and await resp.next_piece(5) is None
            resp.release()
            resp = await req("/until-close")
            assert await resp.read(5) == b"all of it"
            resp.release()
            dead = Origin.from_url("http://127.0.0.1:1")
            with pytest.raises(UpstreamConnectError):
                await pool.request(dead, "GET", "/", [], b"", first_byte_timeout_s=1)
            with pytest.raises(ValueError):
                Origin.from_url("ftp://x")
        finally:
            await pool.close()
            await backend.stop()

    arun(main)


def test_upstream_pool_caps_connections_and_queues_the_rest() -> None:
    """At most ``max_connections`` per endpoint; then a FIFO queue of ``max_queue``; beyond
    it, or after ``queue_timeout_s``, UpstreamSaturated. A cancelled waiter leaves the queue;
    released connections go to the waiters (no new connects)."""

    async def main() -> None:
        gate = asyncio.Event()

        async def gated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            while True:
                await read_request(reader)
                await gate.wait()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()

        backend = RawBackend(gated)
        origin = await backend.start()
        pool = UpstreamPool(max_connections=2, max_queue=2, queue_timeout_s=10)

        async def one() -> bytes:
            resp = await pool.request(origin, "GET", "/", [], b"", first_byte_timeout_s=10)
            body = await resp.read(10)
            resp.release()
            return body

        try:
            tasks = [asyncio.create_task(one()) for _ in range(4)]
            await asyncio.sleep(0.2)
            assert pool.busy(origin) == 2 and pool.queued(origin) == 2
            with pytest.raises(UpstreamSaturated):  # the queue is full: at once
                await pool.request(origin, "GET", "/", [], b"", first_byte_timeout_s=1)
            tasks[3].cancel()  # a client gone while waiting leaves the queue
            await asyncio.sleep(0)
            assert pool.queued(origin) == 1
            gate.set()
            assert await asyncio.gather(*tasks[:3]) == [b"ok"] * 3
            assert backend.connections == 2  # the waiter got a released connection
            assert pool.busy(origin) == 0 and pool.queued(origin) == 0
            # Waiting longer than queue_timeout_s: saturated too.
            gate.clear()
            pool.queue_timeout_s = 0.2
            held = [asyncio.create_task(one()) for _ in range(2)]
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            with pytest.raises(UpstreamSaturated):
                await pool.request(origin, "GET", "/", [], b"", first_byte_timeout_s=1)
            assert 0.1 < time.monotonic() - t0 < 2
            gate.set()
            await asyncio.gather(*held)
            assert pool.busy(origin) == 0
        finally:
            await pool.close()
            await backend.stop()

    arun(main)


def test_upstream_connect_errors_say_whether_the_endpoint_refused() -> None:
    async def main() -> None:
        pool = UpstreamPool(connect_timeout_s=1)
        with pytest.raises(UpstreamConnectError) as info:
            await pool.request(
                Origin.from_url("http://127.0.0.1:1"), "GET", "/", [], b"", first_byte_timeout_s=1
            )
        assert info.value.refused and pool.busy(Origin.from_url("http://127.0.0.1:1")) == 0
        # A connect that times out (a full accept backlog looks like this) did not refuse.
        import socket

        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # never accepts: connects beyond the backlog hang
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(8):
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(("127.0.0.1", port))
                fillers.append(s)
            pool.connect_timeout_s = 0.3
            origin = Origin.from_url(f"http://127.0.0.1:{port}")
            with pytest.raises(UpstreamConnectError) as info:
                await pool.request(origin, "GET", "/", [], b"", first_byte_timeout_s=1)
            assert not info.value.refused and pool.busy(origin) == 0
        finally:
            for s in fillers:
                s.close()
            listener.close()
            await pool.close()

    arun(main)


def test_server_closes_idle_keep_alive_connections_but_not_slow_handlers() -> None:
    async def main() -> None:
        async def slow(req: HttpRequest, resp: HttpResponse) -> None:
            await asyncio.sleep(0.8)  # longer than every client timeout: still answered
            resp.send(200, [], b"done")

        server = HttpServer(slow, error_reply, header_timeout_s=0.3, keep_alive_timeout_s=0.3)
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nhost: h\r\n\r\n")
            out = await asyncio.wait_for(reader.readuntil(b"done"), 5)
            assert out.startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert await asyncio.wait_for(reader.read(), 5) == b""  # idle: closed, silently
            assert time.monotonic() - t0 < 2
            writer.close()
        finally:
            await server.close()

    arun(main)
