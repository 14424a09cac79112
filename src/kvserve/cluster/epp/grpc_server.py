"""A gRPC server on HTTP/2 inside the router's event loop: the EPP's transport.

Owns the HTTP/2 connections (cleartext, prior knowledge, as Envoy's gRPC clusters and gRPC
clients connect): their frames, stream lifetimes and flow control both ways, and gRPC's framing
on them, in the loop that runs the scheduling core. Header blocks are HPACK-decoded and
-encoded by PyPI's ``hpack``. No second thread, no completion queue: a message costs a frame
parse and a protobuf parse, and its answer one socket write (grpcio's server spent ~0.7 ms of
CPU per ext_proc request on its own machinery, ``h2``'s state machines ~0.35 ms more than
this: ``benchmarks/results/epp*.md``).

A method is served one of two ways: a ``handler`` coroutine per call (a task that reads and
writes the call: unary, server streaming, bidirectional), or a ``stream`` handler whose
``on_message`` is called with each message in the connection's own callback (no task and no
loop turn per message; the answers written then leave in the same socket write at the end of
that callback). An ``on_message`` that must wait returns an awaitable: the call's later
messages are held until it is done. The ext_proc stream is served this way: three messages
each way per request, each answered in the loop turn it arrived in.

A peer's header blocks decoded once are kept, by their bytes, while the HPACK dynamic table
stays as it was (Envoy opens every ext_proc stream with the same block of indexed fields and
one literal that is never indexed): a stream's headers cost a dict lookup, not a decode.

Our header blocks never touch the peer's HPACK dynamic table: the fixed ones are encoded once,
each field a static-table index or a never-indexed literal, and so are error trailers (one
shared, stateless encoder), so the peer's SETTINGS_HEADER_TABLE_SIZE never concerns us.

Not supported (nothing the EPP needs): message compression (a compressed message ends its
call with UNIMPLEMENTED), TLS (a sidecar or the mesh terminates it), server push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

from hpack import Decoder, Encoder, HPACKError, NeverIndexedHeaderTuple

logger = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
# Error codes (RFC 9113 section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 6, 7, 8, 9
# Settings
HEADER_TABLE_SIZE, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 1, 3, 4, 5
MAX_HEADER_LIST_SIZE = 6
# gRPC status codes
OK, CANCELLED, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED = 0, 1, 3, 5, 8
UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 12, 13, 14

_FRAME = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
_MESSAGE = struct.Struct(">BI")  # gRPC: compressed flag, length
_DATA_MESSAGE = struct.Struct(">IBIBI")  # a DATA frame's header, then its message's prefix
_U32 = struct.Struct(">I")
_DEFAULT_WINDOW = 65535
_WINDOW = 1 << 24  # what we let a peer send ahead, per stream and per connection
_MAX_FRAME = 1 << 20  # the largest frame we accept (a 1 MB body in one or two)
_MAX_WINDOW = (1 << 31) - 1
_MAX_HEADER_BLOCK = 1 << 20  # a header block spread over CONTINUATION frames, at most
_MAX_HEADER_LIST = 1 << 16  # decoded request headers, at most (RFC 9113's count: +32 a field)
_MAX_STREAMS = 1 << 20  # (Envoy keeps one stream per HTTP request in flight: no real limit)
_ENCODER = Encoder()  # only ever given never-indexed fields: its dynamic table stays empty
_DECODED_BLOCKS = 64  # header blocks kept decoded per connection (cleared when the table moves)


def encode_headers(fields: list[tuple[bytes, bytes]]) -> bytes:
    """An HPACK block that leaves the peer's dynamic table as it is."""
    return _ENCODER.encode([NeverIndexedHeaderTuple(k, v) for k, v in fields])


_RESPONSE_HEADERS = encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc")])
_TRAILERS_OK = encode_headers([(b"grpc-status", b"0")])
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")  # kept as is


class GrpcError(Exception):
    """Ends a call with a non-OK status (raised by a handler)."""

    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class StreamHandler(Protocol):
    """A call's messages, handed over as they arrive (``Method.stream``)."""

    def on_message(self, message: Any) -> Awaitable[None] | None:
        """Answer ``message`` (``call.write``); an awaitable when the answer must wait: the
        call's later messages are held until it is done. Raising :class:`GrpcError` (or
        anything else: INTERNAL) ends the call with that status."""

    def on_end(self) -> None:
        """The call is over (the client ended it, reset it, or the connection went): called
        once, after the last ``on_message`` has returned (or its awaitable is done)."""


@dataclass(frozen=True)
class Method:
    """A method: its request message type (``FromString``) and either ``handler``, a
    coroutine run as one task per call that reads and writes the call itself (unary, server
    streaming or bidirectional alike), or ``stream``, which makes the call's
    :class:`StreamHandler` (its messages handled in the connection's callback, no task)."""

    request_type: Any
    handler: Callable[[Call], Awaitable[None]] | None = None
    stream: Callable[[Call], StreamHandler] | None = None


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack((len(payload) << 8) | kind, flags, stream_id) + payload


def _trailers(status: int, message: str) -> bytes:
    if status == OK and not message:
        return _TRAILERS_OK
    fields = [(b"grpc-status", str(status).encode())]
    if message:  # percent-encoded, as gRPC's wire format asks
        text = quote(message[:1024], safe=_MESSAGE_SAFE)
        fields.append((b"grpc-message", text.encode()))
    return encode_headers(fields)


class Call:
    """One gRPC call (an HTTP/2 stream): ``await read()`` the next request message (None at
    the client's end or when the call is gone), ``write(message)`` an answer."""

    __slots__ = (
        "conn", "stream_id", "method", "metadata", "inbox", "ended", "reset", "finished",
        "_waiter", "_buf", "_recv_unacked", "send_window", "_pending", "_headers_sent",
        "task", "handler", "_busy", "_over",
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
        self._recv_unacked = 0
        self.send_window = conn.peer_initial_window
        self._pending: deque[tuple[bool, bytes]] = deque()  # (is_trailers, payload)
        self._headers_sent = False
        self.task: asyncio.Task | None = None
        self.handler: StreamHandler | None = None  # Method.stream's, when the method has one
        self._busy = False  # the handler's awaitable runs: messages wait in the inbox
        self._over = False  # the handler's on_end was called

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
        """Send one message (queued while the peer's flow-control window is closed);
        ``bytes`` are a message already serialized."""
        if self.reset or self.finished:
            return
        payload = message if type(message) is bytes else message.SerializeToString()
        conn = self.conn
        size = len(payload) + 5
        if not self._headers_sent:
            self._headers_sent = True
            conn.write(_frame(HEADERS, END_HEADERS, self.stream_id, _RESPONSE_HEADERS))
        if (
            not self._pending
            and size <= self.send_window
            and size <= conn.send_window
            and size <= conn.peer_max_frame
        ):  # the usual case: one DATA frame now (frame and message prefix packed at once)
            self.send_window -= size
            conn.send_window -= size
            head = _DATA_MESSAGE.pack((size << 8) | DATA, 0, self.stream_id, 0, len(payload))
            conn.write(head + payload)
            return
        self._pending.append((False, _MESSAGE.pack(0, len(payload)) + payload))
        self.flush()

    def after_answers(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` once the answers written so far have gone to the socket: work
        the peer does not wait for (bookkeeping, metrics), off its critical path. Still
        before the connection's next message is handled, so that message sees its effects."""
        self.conn.after_answers(fn, args)

    def finish(self, status: int = OK, message: str = "") -> None:
        """End the call with ``status`` (trailers; a trailers-only answer without messages)."""
        if self.reset or self.finished:
            return
        self.finished = True
        if not self._headers_sent:
            self._headers_sent = True
            block = _RESPONSE_HEADERS + _trailers(status, message)
            self.conn.write(_frame(HEADERS, END_HEADERS | END_STREAM, self.stream_id, block))
            self.conn.call_done(self)
            return
        self._pending.append((True, _trailers(status, message)))
        self.flush()

    def flush(self) -> None:
        """Send what the windows allow; the rest waits for the peer's WINDOW_UPDATE."""
        conn = self.conn
        pending = self._pending
        while pending and not self.reset:
            is_trailers, data = pending[0]
            if is_trailers:
                pending.popleft()
                conn.write(_frame(HEADERS, END_HEADERS | END_STREAM, self.stream_id, data))
                conn.call_done(self)
                return
            n = min(len(data), self.send_window, conn.send_window, conn.peer_max_frame)
            if n <= 0:
                conn.blocked[self.stream_id] = self
                return
            conn.write(_frame(DATA, 0, self.stream_id, data[:n]))
            self.send_window -= n
            conn.send_window -= n
            if n == len(data):
                pending.popleft()
            else:
                pending[0] = (False, data[n:])
        conn.blocked.pop(self.stream_id, None)

    # ------------------------------------------------------------------ from the connection

    def _received(self, data: bytes, end_stream: bool) -> None:
        if self.ended:
            return
        self._recv_unacked += len(data)
        if self._recv_unacked >= _WINDOW // 2 and not end_stream:
            self.conn.write(_frame(WINDOW_UPDATE, 0, self.stream_id, _U32.pack(self._recv_unacked)))
            self._recv_unacked = 0
        buf = self._buf
        if buf:
            buf += data
            src: bytes | bytearray = buf
        else:  # nothing held over (a message per DATA frame, as Envoy sends): read from data
            src = data
        held = src is buf
        pos, n = 0, len(src)
        limit = self.conn.server.max_message_bytes
        while n - pos >= 5:
            compressed, length = _MESSAGE.unpack_from(src, pos)
            if length > limit:
                self._abort(RESOURCE_EXHAUSTED, f"message of {length} bytes over {limit}")
                return
            end = pos + 5 + length
            if end > n:
                break
            payload = bytes(src[pos + 5 : end]) if held else src[pos + 5 : end]
            pos = end
            if held:
                del buf[:pos]
                pos, n = 0, len(buf)
            if compressed:
                self._abort(UNIMPLEMENTED, "compressed messages are not supported")
                return
            try:
                message = self.method.request_type.FromString(payload)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - protobuf's DecodeError, whatever its module
                self._abort(INTERNAL, "request message does not parse")
                return
            if self.handler is None or self._busy:
                self.inbox.append(message)
            else:
                self._dispatch(message)
                if self.reset:
                    return
        if not held and pos < n:  # a message cut short: kept for the next frame
            buf += src[pos:]
        if end_stream:
            self.ended = True
            if self.handler is not None and not self._busy:
                self._end(OK, "")
        self._wake()

    # ------------------------------------------------------------------ stream handlers

    def _dispatch(self, message: Any) -> None:
        """One message to the stream handler, in the connection's callback."""
        if self.conn._after:  # an earlier message's answers first, then its bookkeeping
            self.conn._flush()
            self.conn._run_after()
        try:
            pending = self.handler.on_message(message)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - GrpcError, or a handler's bug: ends the call
            self._failed(e)
            return
        if pending is not None:  # the answer waits: hold later messages until it is done
            self._busy = True
            self.task = self.conn.loop.create_task(self._drain(pending))

    async def _drain(self, pending: Awaitable[None]) -> None:
        """Await the handler, then hand it the messages that arrived meanwhile."""
        try:
            await pending
            while self.inbox and not self.reset:
                pending = self.handler.on_message(self.inbox.popleft())  # type: ignore[union-attr]
                if pending is not None:
                    await pending
        except asyncio.CancelledError:
            self._busy = False
            self._end(CANCELLED, "server stopping")
            return
        except Exception as e:  # noqa: BLE001
            self._busy = False
            self._failed(e)
            return
        self._busy = False
        self.task = None
        if self.ended:
            self._end(OK, "")

    def _failed(self, e: Exception) -> None:
        if isinstance(e, GrpcError):
            status, message = e.status, e.message
        else:
            logger.error("gRPC stream handler failed", exc_info=e)
            status, message = INTERNAL, f"{type(e).__name__}: {e}"
        self._end(status, message)
        self._gone(send_reset=True)  # (the client may still be sending)

    def _end(self, status: int, message: str) -> None:
        """The handler's call is over: ``on_end`` once, then our status."""
        if not self._over:
            self._over = True
            self.conn.server.calls -= 1
            try:
                self.handler.on_end()  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001
                logger.exception("gRPC stream handler's on_end failed")
        self.finish(status, message)

    def _abort(self, status: int, message: str) -> None:
        """End the call now (the client is still sending): trailers, then RST_STREAM."""
        self.finish(status, message)
        self._gone(send_reset=True)

    def _gone(self, send_reset: bool = False) -> None:
        if send_reset and not self.reset:
            self.conn.write(_frame(RST_STREAM, 0, self.stream_id, _U32.pack(NO_ERROR)))
        self.reset = self.ended = True
        self.inbox.clear()
        self._pending.clear()
        self.conn.blocked.pop(self.stream_id, None)
        self.conn.streams.pop(self.stream_id, None)
        if self.handler is not None and not self._busy:
            self._end(CANCELLED, "")  # (nothing is sent: the call is gone)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class Http2Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.preface = False
        self.decoder = Decoder(max_header_list_size=_MAX_HEADER_LIST)
        self.streams: dict[int, Call] = {}
        self.blocked: dict[int, Call] = {}
        self.last_stream = 0
        self.send_window = _DEFAULT_WINDOW
        self.peer_initial_window = _DEFAULT_WINDOW
        self.peer_max_frame = 16384
        self._recv_unacked = 0
        self._continuation: tuple[int, int, bytearray] | None = None  # stream, flags, block
        self.going_away = False
        self._out: list[bytes] = []  # frames to send at the end of this turn of the loop
        self._receiving = False  # in data_received: what is written leaves at its end
        self._after: list[tuple[Callable[..., object], tuple]] = []  # see after_answers
        self._decoded: dict[bytes, dict[bytes, bytes]] = {}  # header block -> its fields

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        settings = b"".join(
            struct.pack(">HI", k, v)
            for k, v in (
                (MAX_CONCURRENT_STREAMS, _MAX_STREAMS),
                (INITIAL_WINDOW_SIZE, _WINDOW),
                (MAX_FRAME_SIZE, _MAX_FRAME),
                (MAX_HEADER_LIST_SIZE, _MAX_HEADER_LIST),
            )
        )
        self.write(
            _frame(SETTINGS, 0, 0, settings)
            + _frame(WINDOW_UPDATE, 0, 0, _U32.pack(_WINDOW - _DEFAULT_WINDOW))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for call in list(self.streams.values()):
            call._gone()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self._receiving = True
        try:
            self._data_received(data)
        finally:
            self._receiving = False
            if self._out:
                self._flush()
            if self._after:
                self._run_after()
            server = self.server
            if server.after_read is not None and not server.calls:
                server.after_read()

    def _data_received(self, data: bytes) -> None:
        buf = self.buf
        if buf or not self.preface:
            buf += data
            if not self.preface:
                head = bytes(buf[: len(PREFACE)])
                if not PREFACE.startswith(head):  # not HTTP/2 with prior knowledge
                    self._go_away(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if len(head) < len(PREFACE):
                    return
                del buf[: len(PREFACE)]
                self.preface = True
            src: bytes | bytearray = buf
        else:  # nothing held over (the usual case): the frames are read from ``data`` itself
            src = data if type(data) is bytes else bytes(data)
        held = src is buf  # (a slice of the buffer is copied to bytes, one of data already is)
        pos, n = 0, len(src)
        try:
            while n - pos >= 9:
                head, flags, stream_id = _FRAME.unpack_from(src, pos)
                length, kind = head >> 8, head & 0xFF
                if length > _MAX_FRAME:
                    raise _ConnectionError(FRAME_SIZE_ERROR, "frame over the announced size")
                end = pos + 9 + length
                if end > n:
                    break
                payload = bytes(src[pos + 9 : end]) if held else src[pos + 9 : end]
                pos = end
                if kind == DATA and self._continuation is None:  # (most frames: no dispatch)
                    self._data(flags, stream_id & 0x7FFFFFFF, payload)
                else:
                    self._frame_received(kind, flags, stream_id & 0x7FFFFFFF, payload)
                if self.transport is None:
                    return
        except _ConnectionError as e:
            self._go_away(e.code, str(e))
            return
        if held:
            del buf[:pos]
        elif pos < n:  # a frame cut short: kept for the next read
            buf += src[pos:]

    # ------------------------------------------------------------------ frames

    def _frame_received(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self._continuation is not None and kind != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            if not sid:
                raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
            start, end = 0, len(payload)
            if flags & PADDED:
                start, end = 1, end - payload[0]
            if flags & PRIORITY_FLAG:
                start += 5
            if start > end:
                raise _ConnectionError(PROTOCOL_ERROR, "bad padding")
            block = bytearray(payload[start:end])
            if flags & END_HEADERS:
                self._headers(sid, flags, bytes(block))
            else:
                self._continuation = (sid, flags, block)
        elif kind == CONTINUATION:
            if self._continuation is None or self._continuation[0] != sid:
                raise _ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION")
            self._continuation[2].extend(payload)
            if len(self._continuation[2]) > _MAX_HEADER_BLOCK:
                raise _ConnectionError(PROTOCOL_ERROR, "header block too large")
            if flags & END_HEADERS:
                first_sid, first_flags, block = self._continuation
                self._continuation = None
                self._headers(first_sid, first_flags, bytes(block))
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            if not flags & ACK:
                self.write(_frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            call = self.streams.get(sid)
            if call is not None:
                call._gone()
        elif kind == GOAWAY:
            self.going_away = True
        # PRIORITY, PUSH_PROMISE (a client never sends it) and unknown types: ignored

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        size = len(payload)  # padding counts against flow control too
        if flags & PADDED and payload:
            payload = payload[1 : len(payload) - payload[0]]
        self._recv_unacked += size
        if self._recv_unacked >= _WINDOW // 2:
            self.write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_unacked)))
            self._recv_unacked = 0
        call = self.streams.get(sid)
        if call is not None:
            call._received(payload, bool(flags & END_STREAM))

    def _decode(self, block: bytes) -> dict[bytes, bytes]:
        """The fields of a header block (always decoded, even for a stream we ignore: the
        dynamic table must follow the peer's). A block whose decoding left the table as it
        was is kept: the same bytes decode to the same fields until the table moves."""
        fields = self._decoded.get(block)
        if fields is not None:
            return fields
        table = self.decoder.header_table
        entries = table.dynamic_entries
        before = (table.maxsize, len(entries), entries[0] if entries else None)
        try:
            decoded = dict(self.decoder.decode(block, raw=True))
        except HPACKError as e:
            raise _ConnectionError(COMPRESSION_ERROR, str(e)) from None
        entries = table.dynamic_entries
        if before == (table.maxsize, len(entries), entries[0] if entries else None):
            if len(self._decoded) >= _DECODED_BLOCKS:
                self._decoded.clear()
            self._decoded[block] = decoded
        else:  # the table moved: indexed fields of the blocks kept may mean others now
            self._decoded.clear()
        return decoded

    def _headers(self, sid: int, flags: int, block: bytes) -> None:
        metadata = self._decode(block)
        end_stream = bool(flags & END_STREAM)
        call = self.streams.get(sid)
        if call is not None:  # trailers of a request
            if end_stream:
                call._received(b"", True)
            return
        if sid <= self.last_stream or not sid & 1:
            if sid <= self.last_stream:
                return  # a stream already closed: ignore
            raise _ConnectionError(PROTOCOL_ERROR, "bad stream id")
        self.last_stream = sid
        if self.going_away or self.server.stopping:
            self.write(_frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        method = self.server.methods.get(metadata.get(b":path", b""))
        call = Call(self, sid, method, metadata)
        self.streams[sid] = call
        call.ended = end_stream
        if method is None:
            path = metadata.get(b":path", b"").decode("latin-1")
            call.finish(UNIMPLEMENTED, f"unknown method {path}")
            return
        if method.stream is None:
            call.task = self.loop.create_task(self.server.run(call))
            return
        self.server.calls += 1
        call.handler = method.stream(call)
        if end_stream:  # no messages at all
            call._end(OK, "")

    def _settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS length")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == INITIAL_WINDOW_SIZE:
                if value > _MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "window too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for call in self.streams.values():
                    call.send_window += delta
            elif key == MAX_FRAME_SIZE:
                if not 16384 <= value <= 16777215:
                    raise _ConnectionError(PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            # HEADER_TABLE_SIZE: we never index; the others do not concern us
        self.write(_frame(SETTINGS, ACK, 0))
        self._unblock()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE length")
        inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            self.send_window += inc
            if self.send_window > _MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "connection window overflow")
        else:
            call = self.streams.get(sid)
            if call is None:
                return
            call.send_window += inc
        self._unblock()

    def _unblock(self) -> None:
        for call in list(self.blocked.values()):
            if self.send_window <= 0:
                return
            call.flush()

    # ------------------------------------------------------------------ output

    def write(self, data: bytes) -> None:
        """Queue ``data``; what is queued in one turn of the loop goes out in one write (a
        loopback send costs ~0.1 ms of CPU here: answers of one message share it), at the
        end of ``data_received`` for what its messages' handlers write."""
        if self.transport is None:
            return
        if not self._out and not self._receiving:
            self.loop.call_soon(self._flush)
        self._out.append(data)

    def after_answers(self, fn: Callable[..., object], args: tuple = ()) -> None:
        """``fn(*args)`` after the frames queued so far are written (:meth:`Call.after_answers`):
        at the end of ``data_received`` (or before its next message), else in a later
        callback of the loop, after the flush it scheduled."""
        if not self._receiving:
            self.loop.call_soon(fn, *args)
        else:
            self._after.append((fn, args))

    def _run_after(self) -> None:
        after, self._after = self._after, []
        for fn, args in after:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - bookkeeping's bug: logged, the calls go on
                logger.exception("gRPC after-answers callback failed")

    def _flush(self) -> None:
        if self._out:
            if self.transport is not None:
                self.transport.write(b"".join(self._out))
            self._out.clear()

    def call_done(self, call: Call) -> None:
        """We sent the call's END_STREAM: forget it (RST_STREAM NO_ERROR if the client has
        not ended its side: the call is over)."""
        call._gone(send_reset=not call.ended)

    def _go_away(self, code: int, reason: str) -> None:
        logger.warning("EPP HTTP/2 connection error (%s): %s", code, reason)
        payload = _U32.pack(self.last_stream) + _U32.pack(code) + reason.encode()[:256]
        self.write(_frame(GOAWAY, 0, 0, payload))
        self._close()

    def go_away(self) -> None:
        """Graceful: no new streams (GOAWAY, NO_ERROR); the open ones go on."""
        self.going_away = True
        self.write(_frame(GOAWAY, 0, 0, _U32.pack(self.last_stream) + _U32.pack(NO_ERROR)))

    def _close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class GrpcServer:
    """``methods``: ``{"/package.Service/Method": Method}``; listens on one TCP port."""

    def __init__(self, methods: dict[str, Method], max_message_bytes: int = 4 << 20) -> None:
        self.methods = {k.encode(): v for k, v in methods.items()}
        self.max_message_bytes = max_message_bytes
        self.connections: set[Http2Connection] = set()
        self.calls = 0  # calls running
        self.stopping = False
        # called at the end of a read that leaves no call open, its answers written and its
        # after-answers work done: a quiet moment, no call waits on us or on the peer's next
        # message (the EPP's garbage collection: epp/idle_gc.py)
        self.after_read: Callable[[], object] | None = None
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
            for call in list(conn.streams.values()):  # (their handlers' on_end: now)
                call._gone()
        for t in tasks:
            t.cancel()
        if tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait(tasks, timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None
