"""A gRPC server on HTTP/2 inside the router's event loop: the EPP's transport.

Owns gRPC's side of the HTTP/2 connections (cleartext, prior knowledge, as Envoy's gRPC
clusters and gRPC clients connect): one task per call, the 5-byte message framing, statuses
in trailers, and when a connection's frames go out (those of one loop turn in one write).
The HTTP/2 protocol itself (frames, HPACK, stream states, flow control both ways) is PyPI's
``h2`` (python-hyper), fed the socket's bytes: no second thread, no completion queue (grpcio's
server spent ~0.7 ms of CPU per ext_proc request on its own machinery:
``benchmarks/results/epp*.md``).

Not supported (nothing the EPP needs): message compression (a compressed message ends its
call with UNIMPLEMENTED), TLS (a sidecar or the mesh terminates it), server push. A client's
GOAWAY ends its connection's calls at once (``h2`` sends nothing more after one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RemoteSettingsChanged,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes
from hyperframe.frame import GoAwayFrame

logger = logging.getLogger(__name__)

# gRPC status codes
OK, CANCELLED, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED = 0, 1, 3, 5, 8
UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 12, 13, 14

_MESSAGE = struct.Struct(">BI")  # gRPC: compressed flag, length
_DEFAULT_WINDOW = 65535
_WINDOW = 1 << 24  # what we let a peer send ahead, per stream and per connection
_MAX_FRAME = 1 << 20  # the largest frame we accept (a 1 MB body in one or two)
_SETTINGS = {
    SettingCodes.MAX_CONCURRENT_STREAMS: 1 << 20,  # (h2's default, 100, would end the
    SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW,  # connection on the 101st open stream)
    SettingCodes.MAX_FRAME_SIZE: _MAX_FRAME,
}
# Inbound headers validated and normalized by h2 (RFC 9113's rules); ours are fixed and valid.
_CONFIG = H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
)
_RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_TRAILERS_OK = [(b"grpc-status", b"0")]
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")  # kept as is


class GrpcError(Exception):
    """Ends a call with a non-OK status (raised by a handler)."""

    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Method:
    """A method: its request message type (``FromString``) and handler (it reads and
    writes the call itself: unary, server streaming or bidirectional alike)."""

    request_type: Any
    handler: Callable[[Call], Awaitable[None]]


def _trailers(status: int, message: str) -> list[tuple[bytes, bytes]]:
    if status == OK and not message:
        return _TRAILERS_OK
    fields = [(b"grpc-status", str(status).encode())]
    if message:  # percent-encoded, as gRPC's wire format asks
        text = quote(message[:1024], safe=_MESSAGE_SAFE)
        fields.append((b"grpc-message", text.encode()))
    return fields


class Call:
    """One gRPC call (an HTTP/2 stream): ``await read()`` the next request message (None at
    the client's end or when the call is gone), ``write(message)`` an answer."""

    __slots__ = (
        "conn", "stream_id", "method", "metadata", "inbox", "ended", "reset", "finished",
        "_waiter", "_buf", "_pending", "_headers_sent", "task",
    )  # fmt: skip

    def __init__(
        self, conn: Http2Connection, stream_id: int, method: Method | None, metadata: dict
    ) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.method = method
        self.metadata = metadata  # request headers (bytes -> bytes)
        self.inbox: deque[Any] = deque()
        self.ended = False  # the client sent END_STREAM (or the call is gone)
        self.reset = False  # the call is gone (RST_STREAM, connection lost)
        self.finished = False  # we sent END_STREAM
        self._waiter: asyncio.Future | None = None
        self._buf = bytearray()
        # DATA payloads, or a trailers list (the last item), waiting for the peer's window
        self._pending: deque[bytes | memoryview | list] = deque()
        self._headers_sent = False
        self.task: asyncio.Task | None = None

    async def read(self) -> Any | None:
        while not self.inbox:
            if self.ended:
                return None
            self._waiter = self.conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.inbox.popleft()

    async def wait_closed(self) -> None:
        """Until the call is gone (reset by the client, connection lost, or ended by us)."""
        while not self.reset:
            self._waiter = self.conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def write(self, message: Any) -> None:
        """Send one message (queued while the peer's flow-control window is closed)."""
        if self.reset or self.finished:
            return
        payload = message.SerializeToString()
        self._pending.append(_MESSAGE.pack(0, len(payload)) + payload)
        self.flush()

    def finish(self, status: int = OK, message: str = "") -> None:
        """End the call with ``status`` (trailers; a trailers-only answer without messages)."""
        if self.reset or self.finished:
            return
        self.finished = True
        trailers = _trailers(status, message)
        if not self._headers_sent:
            self._headers_sent = True
            with contextlib.suppress(ProtocolError):  # (the stream or connection is closed)
                self.conn.h2.send_headers(self.stream_id, _RESPONSE_HEADERS + trailers, True)
            self.conn.changed()
            self.conn.call_done(self)
            return
        self._pending.append(trailers)
        self.flush()

    def flush(self) -> None:
        """Send what the windows allow; the rest waits for the peer's WINDOW_UPDATE."""
        conn, h2, sid = self.conn, self.conn.h2, self.stream_id
        pending = self._pending
        try:
            if not self._headers_sent and pending:
                self._headers_sent = True
                h2.send_headers(sid, _RESPONSE_HEADERS)
            while pending and not self.reset:
                data = pending[0]
                if isinstance(data, list):  # the trailers
                    pending.popleft()
                    h2.send_headers(sid, data, end_stream=True)
                    conn.changed()
                    conn.call_done(self)
                    return
                n = min(len(data), h2.local_flow_control_window(sid), h2.max_outbound_frame_size)
                if n <= 0:
                    conn.blocked[sid] = self
                    break
                if n == len(data):
                    h2.send_data(sid, data)
                    pending.popleft()
                else:  # (h2 copies a memoryview's part; the rest stays a view)
                    view = memoryview(data)
                    h2.send_data(sid, view[:n])
                    pending[0] = view[n:]
            else:
                conn.blocked.pop(sid, None)
        except ProtocolError:  # the stream or the connection is closed: the call is gone
            self._gone()
        conn.changed()

    # ------------------------------------------------------------------ from the connection

    def _received(self, data: bytes) -> None:
        if self.ended:
            return
        buf = self._buf
        buf += data
        limit = self.conn.server.max_message_bytes
        while len(buf) >= 5:
            compressed, length = _MESSAGE.unpack_from(buf)
            if length > limit:
                self._abort(RESOURCE_EXHAUSTED, f"message of {length} bytes over {limit}")
                return
            if len(buf) < 5 + length:
                break
            payload = bytes(buf[5 : 5 + length])
            del buf[: 5 + length]
            if compressed:
                self._abort(UNIMPLEMENTED, "compressed messages are not supported")
                return
            try:
                message = self.method.request_type.FromString(payload)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - protobuf's DecodeError, whatever its module
                self._abort(INTERNAL, "request message does not parse")
                return
            self.inbox.append(message)
        self._wake()

    def _end_received(self) -> None:
        self.ended = True
        self._wake()

    def _abort(self, status: int, message: str) -> None:
        """End the call now (the client is still sending): trailers, then RST_STREAM."""
        self.finish(status, message)
        self._gone(send_reset=True)

    def _gone(self, send_reset: bool = False) -> None:
        if send_reset and not self.reset:
            # (h2 raises if the stream is already closed both ways: nothing to reset)
            with contextlib.suppress(ProtocolError):
                self.conn.h2.reset_stream(self.stream_id, ErrorCodes.NO_ERROR)
            self.conn.changed()
        self.reset = self.ended = True
        self.inbox.clear()
        self._pending.clear()
        self.conn.blocked.pop(self.stream_id, None)
        self.conn.streams.pop(self.stream_id, None)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class Http2Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection: an ``h2`` connection on a socket."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.h2 = H2Connection(_CONFIG)
        self.streams: dict[int, Call] = {}
        self.blocked: dict[int, Call] = {}
        self.going_away = False
        self._flush_pending = False
        self._on_event = {
            RequestReceived: self._request,
            DataReceived: self._data,
            StreamEnded: self._stream_ended,
            StreamReset: self._stream_reset,
            WindowUpdated: self._unblock,
            RemoteSettingsChanged: self._unblock,
            ConnectionTerminated: self._terminated,
        }

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        h2 = self.h2
        h2.initiate_connection()
        h2.update_settings(_SETTINGS)
        h2.increment_flow_control_window(_WINDOW - _DEFAULT_WINDOW)
        self.changed()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for call in list(self.streams.values()):
            call._gone()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except ProtocolError as e:  # h2 queued its GOAWAY: send it and close
            logger.warning("EPP HTTP/2 connection error: %s", e)
            self._close(go_away=False)
            return
        on_event = self._on_event
        for event in events:
            handler = on_event.get(type(event))
            if handler is not None:
                handler(event)
        self.changed()  # h2's own answers: SETTINGS and PING acks, window updates

    # ------------------------------------------------------------------ events

    def _request(self, ev: RequestReceived) -> None:
        sid = ev.stream_id
        if self.going_away or self.server.stopping:
            with contextlib.suppress(ProtocolError):
                self.h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        metadata = dict(ev.headers)
        path = metadata.get(b":path", b"")
        method = self.server.methods.get(path)
        call = Call(self, sid, method, metadata)
        self.streams[sid] = call
        call.ended = ev.stream_ended is not None
        if method is None:
            call.finish(UNIMPLEMENTED, f"unknown method {path.decode('latin-1')}")
            return
        call.task = self.loop.create_task(self.server.run(call))

    def _data(self, ev: DataReceived) -> None:
        sid = ev.stream_id
        # Buffered (up to the message size limit), so handed back to the peer at once
        self.h2.acknowledge_received_data(ev.flow_controlled_length, sid)
        call = self.streams.get(sid)
        if call is not None:
            call._received(ev.data)

    def _stream_ended(self, ev: StreamEnded) -> None:
        call = self.streams.get(ev.stream_id)
        if call is not None:
            call._end_received()

    def _stream_reset(self, ev: StreamReset) -> None:
        call = self.streams.get(ev.stream_id)
        if call is not None:
            call._gone()

    def _unblock(self, ev: object = None) -> None:
        for call in list(self.blocked.values()):
            call.flush()

    def _terminated(self, ev: ConnectionTerminated) -> None:
        """The client's GOAWAY: h2 sends nothing more on this connection, so its calls end."""
        self.going_away = True
        for call in list(self.streams.values()):
            call._gone()
        self._close(go_away=False)

    # ------------------------------------------------------------------ output

    def changed(self) -> None:
        """h2 has (or may have) frames to send: they go out at the end of this loop turn,
        all in one write (a loopback send costs ~0.1 ms of CPU here: answers of one message
        share it)."""
        if not self._flush_pending and self.transport is not None:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        data = self.h2.data_to_send()
        if data and self.transport is not None:
            self.transport.write(data)

    def call_done(self, call: Call) -> None:
        """We sent the call's END_STREAM: forget it (RST_STREAM NO_ERROR if the client has
        not ended its side: the call is over)."""
        call._gone(send_reset=not call.ended)

    def go_away(self) -> None:
        """Graceful: no new streams (GOAWAY NO_ERROR naming the last stream); the open ones
        go on. Written beside h2, whose state machine allows nothing after a GOAWAY
        (python-hyper/h2#1181); h2's own closes the connection in :meth:`_close`."""
        self.going_away = True
        if self.transport is None:
            return
        self._flush()
        frame = GoAwayFrame(0, last_stream_id=self.h2.highest_inbound_stream_id)
        self.transport.write(frame.serialize())

    def _close(self, go_away: bool = True) -> None:
        if self.transport is None:
            return
        if go_away:
            with contextlib.suppress(ProtocolError):
                self.h2.close_connection()
        self._flush()
        self.transport.close()


class GrpcServer:
    """``methods``: ``{"/package.Service/Method": Method}``; listens on one TCP port."""

    def __init__(self, methods: dict[str, Method], max_message_bytes: int = 4 << 20) -> None:
        self.methods = {k.encode(): v for k, v in methods.items()}
        self.max_message_bytes = max_message_bytes
        self.connections: set[Http2Connection] = set()
        self.calls = 0  # calls running
        self.stopping = False
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port (``port=0``: a free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Http2Connection(self), host or None, port, reuse_address=True
        )
        return self._server.sockets[0].getsockname()[1]

    async def run(self, call: Call) -> None:
        """A call's task: its handler, then its status."""
        self.calls += 1
        status, message = OK, ""
        try:
            await call.method.handler(call)  # type: ignore[union-attr]
        except GrpcError as e:
            status, message = e.status, e.message
        except asyncio.CancelledError:
            status, message = CANCELLED, "server stopping"
        except Exception as e:  # noqa: BLE001 - a handler's bug ends its call, not the server
            logger.exception("gRPC handler failed")
            status, message = INTERNAL, f"{type(e).__name__}: {e}"
        finally:
            self.calls -= 1
        call.finish(status, message)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Refuse new calls, give the open ones ``grace_s`` to end, then close everything."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.go_away()
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.calls and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        tasks = [c.task for conn in self.connections for c in conn.streams.values() if c.task]
        for conn in list(self.connections):
            conn._close()
        for t in tasks:
            t.cancel()
        if tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait(tasks, timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None
