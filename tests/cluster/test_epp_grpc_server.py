"""The EPP's in-loop gRPC server, against a real gRPC client (grpcio) over loopback sockets:
unary and streaming calls, flow control both ways (a 1 MB message each way through grpcio's
64 KiB windows), errors, cancellation, stop; and its HPACK use (``hpack``) frame by frame."""

from __future__ import annotations

import asyncio
import struct

import grpc
import hpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.cluster.epp.grpc_server import (
    INVALID_ARGUMENT,
    Call,
    GrpcError,
    GrpcServer,
    Method,
)
from kvserve.cluster.epp.health import HealthService

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A bidirectional method for the tests, reusing a protobuf message that carries bytes
# (HealthCheckRequest.service is a string: echo text, including 1 MB of it).
ECHO = "/test.Echo/Chat"


async def _chat(call: Call) -> None:
    """Echo each message; "boom" fails the handler, "bad" ends the call with a status."""
    while (msg := await call.read()) is not None:
        if msg.service == "boom":
            raise RuntimeError("boom")
        if msg.service == "bad":
            raise GrpcError(INVALID_ARGUMENT, "bad request, 100% of it")
        call.write(health_pb2.HealthCheckRequest(service=msg.service))


def _serve(health: HealthService) -> GrpcServer:
    methods = {ECHO: Method(health_pb2.HealthCheckRequest, _chat), **health.methods()}
    return GrpcServer(methods, max_message_bytes=4 << 20)


def test_grpcio_client_health_echo_flow_control_errors_and_cancel():
    async def run() -> None:
        health = HealthService()
        health.set("", SERVING)
        server = _serve(health)
        port = await server.start("127.0.0.1", 0)
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_receive_message_length", 8 << 20)],
        ) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert r.status == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

            # Watch: the status now, then each change
            health.set("readiness", NOT_SERVING)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
            assert (await watch.read()).status == NOT_SERVING
            health.set("readiness", SERVING)
            assert (await asyncio.wait_for(watch.read(), 10)).status == SERVING
            watch.cancel()

            chat = ch.stream_stream(
                ECHO,
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckRequest.FromString,
            )
            big = "".join(chr(97 + i % 26) for i in range(1 << 20))  # 1 MB each way
            call = chat()
            for text in ["a", big, "b" * 70_000]:
                await call.write(health_pb2.HealthCheckRequest(service=text))
                assert (await asyncio.wait_for(call.read(), 30)).service == text
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK

            for text, code in [("boom", grpc.StatusCode.INTERNAL), ("bad", None)]:
                call = chat()
                await call.write(health_pb2.HealthCheckRequest(service=text))
                with pytest.raises(grpc.aio.AioRpcError):
                    await call.read()
                got = await call.code()
                if code is None:
                    assert got == grpc.StatusCode.INVALID_ARGUMENT
                    assert await call.details() == "bad request, 100% of it"
                else:
                    assert got == code and "boom" in await call.details()

            unknown = ch.unary_unary("/test.Nothing/Here")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await unknown(b"", timeout=10)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED

            # A client that goes away mid-call: the handler's read() ends, nothing stays open
            call = chat()
            await call.write(health_pb2.HealthCheckRequest(service="x"))
            await call.read()
            call.cancel()
            for _ in range(500):
                if server.calls == 0:
                    break
                await asyncio.sleep(0.01)
            assert server.calls == 0
        await server.stop()

    asyncio.run(run())


def test_stop_ends_open_calls_and_refuses_new_ones():
    async def run() -> None:
        server = _serve(HealthService())
        port = await server.start("127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            chat = ch.stream_stream(
                ECHO,
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckRequest.FromString,
            )
            call = chat()
            await call.write(health_pb2.HealthCheckRequest(service="x"))
            await call.read()
            await asyncio.wait_for(server.stop(grace_s=0.2), 10)
            assert server.calls == 0
            assert await asyncio.wait_for(call.code(), 10) != grpc.StatusCode.OK

    asyncio.run(run())


def test_many_streams_oversized_message_and_not_http2():
    """Past the common default of 100 concurrent streams (a limit the EPP must not have: Envoy keeps
    one stream per HTTP request in flight); a message over the limit; a client that does not
    speak HTTP/2 loses its connection, not the server."""

    async def run() -> None:
        server = GrpcServer(
            {ECHO: Method(health_pb2.HealthCheckRequest, _chat)}, max_message_bytes=1000
        )
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(reader.read(), 10)  # (a GOAWAY, then EOF)
        assert reader.at_eof()
        writer.close()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            chat = ch.stream_stream(
                ECHO,
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckRequest.FromString,
            )
            calls = [chat() for _ in range(150)]  # all open at once, on one connection
            for i, call in enumerate(calls):
                # (a write waits for a stream: past the server's limit, forever)
                await asyncio.wait_for(
                    call.write(health_pb2.HealthCheckRequest(service=str(i))), 30
                )
            for i, call in enumerate(calls):
                assert (await asyncio.wait_for(call.read(), 30)).service == str(i)
            assert server.calls == 150
            for call in calls:
                await call.done_writing()
            for call in calls:
                assert await asyncio.wait_for(call.code(), 30) == grpc.StatusCode.OK

            call = chat()
            await call.write(health_pb2.HealthCheckRequest(service="x" * 2000))
            assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "over 1000" in await call.details()
        await server.stop()

    asyncio.run(run())


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADERS, _SETTINGS, _GOAWAY = 1, 4, 7


def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", (len(payload) << 8) | kind, flags, sid) + payload


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, int, int, bytes]:
    head = await asyncio.wait_for(reader.readexactly(9), 10)
    n_kind, flags, sid = struct.unpack(">IBI", head)
    payload = await asyncio.wait_for(reader.readexactly(n_kind >> 8), 10)
    return n_kind & 0xFF, flags, sid & 0x7FFFFFFF, payload


def test_hpack_blocks_both_ways_and_compression_error():
    """Request blocks from an indexing encoder (the second refers to the first's dynamic
    entries) decode right; answers leave the client's dynamic table empty; a block that does
    not decode ends the connection with GOAWAY COMPRESSION_ERROR."""

    async def run() -> None:
        server = GrpcServer({ECHO: Method(health_pb2.HealthCheckRequest, _chat)})
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        encoder, decoder = hpack.Encoder(), hpack.Decoder()
        out = _PREFACE + _frame(_SETTINGS, 0, 0)
        for sid, path in ((1, "/x.Y/Z"), (3, "/x.Y/W")):
            fields = [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "epp"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("x-request-id", "a" * 40),
            ]
            out += _frame(_HEADERS, 0x5, sid, encoder.encode(fields))  # END_STREAM|END_HEADERS
        assert len(encoder.header_table.dynamic_entries) >= 2
        writer.write(out)
        answers = {}
        while len(answers) < 2:
            kind, flags, sid, payload = await _read_frame(reader)
            if kind == _HEADERS:
                assert flags & 0x5 == 0x5  # trailers-only, END_STREAM
                answers[sid] = dict(decoder.decode(payload, raw=True))
        assert len(decoder.header_table.dynamic_entries) == 0
        for sid, path in ((1, b"/x.Y/Z"), (3, b"/x.Y/W")):
            assert answers[sid][b":status"] == b"200"
            assert answers[sid][b"grpc-status"] == b"12"  # UNIMPLEMENTED
            assert answers[sid][b"grpc-message"] == b"unknown method " + path

        writer.write(_frame(_HEADERS, 0x5, 5, b"\x80"))  # index 0: not a valid field
        while True:
            kind, flags, sid, payload = await _read_frame(reader)
            if kind == _GOAWAY:
                break
        assert struct.unpack(">II", payload[:8]) == (3, 9)  # last stream 3, COMPRESSION_ERROR
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        assert not server.connections
        await server.stop()

    asyncio.run(run())


_DATA, _RST_STREAM = 0, 3


def _grpc_messages(*texts: str) -> bytes:
    """Length-prefixed gRPC messages (HealthCheckRequest: the text in ``service``)."""
    out = b""
    for text in texts:
        payload = health_pb2.HealthCheckRequest(service=text).SerializeToString()
        out += struct.pack(">BI", 0, len(payload)) + payload
    return out


def _stream_headers(encoder: hpack.Encoder, path: str = ECHO) -> bytes:
    fields = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "epp")]
    return encoder.encode([*fields, ("content-type", "application/grpc"), ("te", "trailers")])


async def _read_answers(reader: asyncio.StreamReader, sid: int, n: int) -> list[str]:
    """The next ``n`` messages of stream ``sid`` (frames of other streams and kinds skipped)."""
    buf, texts = b"", []
    while len(texts) < n:
        kind, _, got, payload = await _read_frame(reader)
        if kind != _DATA or got != sid:
            continue
        buf += payload
        while len(buf) >= 5 and len(buf) >= 5 + struct.unpack(">I", buf[1:5])[0]:
            length = struct.unpack(">I", buf[1:5])[0]
            texts.append(health_pb2.HealthCheckRequest.FromString(buf[5 : 5 + length]).service)
            buf = buf[5 + length :]
    return texts


class _Recorder:
    """A stream handler: echoes each message at once, except ``wait...`` ones, answered after
    a while (later messages must wait behind them); records what happened, in order."""

    def __init__(self, call: Call, events: list) -> None:
        self.call = call
        self.events = events

    def on_message(self, msg):
        self.events.append((self.call.stream_id, "message", msg.service))
        if not msg.service.startswith("wait"):
            self.call.write(health_pb2.HealthCheckRequest(service=msg.service))
            return None

        async def later() -> None:
            await asyncio.sleep(0.3)
            self.events.append((self.call.stream_id, "waited", msg.service))
            self.call.write(health_pb2.HealthCheckRequest(service="done " + msg.service))

        return later()

    def on_end(self) -> None:
        self.events.append((self.call.stream_id, "end", None))


async def _stream_server(handler):
    """A gRPC server with one stream method (``handler`` per call) and a raw connection to it."""
    server = GrpcServer({ECHO: Method(health_pb2.HealthCheckRequest, stream=handler)})
    port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return server, reader, writer, hpack.Encoder()


def test_stream_handlers_keep_message_order_behind_a_wait_and_end_once():
    """Messages of a ``stream`` method are handled as they arrive; one whose answer waits
    holds the later ones back (answers stay in order); the end comes once, after the last
    answer, also when the client resets the stream while an answer is still waited for
    (the EPP releases its in-flight count there: a late pick must not count again)."""

    async def run() -> None:
        events: list = []
        server, reader, writer, encoder = await _stream_server(lambda c: _Recorder(c, events))
        # stream 1: three messages in one frame, the first waits; then the client's end
        writer.write(
            _PREFACE
            + _frame(_SETTINGS, 0, 0)
            + _frame(_HEADERS, 0x4, 1, _stream_headers(encoder))
            + _frame(_DATA, 0, 1, _grpc_messages("wait 1", "a", "b"))
        )
        assert await _read_answers(reader, 1, 3) == ["done wait 1", "a", "b"]
        assert server.calls == 1 and (1, "end", None) not in events
        writer.write(_frame(_DATA, 0x1, 1))  # END_STREAM: the call ends with OK
        while True:
            kind, flags, sid, payload = await _read_frame(reader)
            if kind == _HEADERS and sid == 1:
                assert flags & 0x1 and dict(hpack.Decoder().decode(payload))["grpc-status"] == "0"
                break
        assert [e for e in events if e[0] == 1][-1] == (1, "end", None)
        # stream 3: reset by the client while its answer waits
        writer.write(
            _frame(_HEADERS, 0x4, 3, _stream_headers(encoder))
            + _frame(_DATA, 0, 3, _grpc_messages("wait 3", "c"))
            + _frame(_RST_STREAM, 0, 3, struct.pack(">I", 8))  # CANCEL
        )
        for _ in range(100):
            if (3, "end", None) in events:
                break
            await asyncio.sleep(0.02)
        mine = [e for e in events if e[0] == 3]
        # "c" never reaches the handler: the stream was gone before "wait 3" was answered
        assert mine == [(3, "message", "wait 3"), (3, "waited", "wait 3"), (3, "end", None)]
        assert server.calls == 0 and events.count((1, "end", None)) == 1
        writer.close()
        await server.stop()

    asyncio.run(run())


def test_header_blocks_are_kept_decoded_only_while_the_dynamic_table_holds():
    """A block decoded once is reused by its bytes (Envoy opens every ext_proc stream with
    the same block), but only while the HPACK dynamic table is as it was: after a block
    that adds an entry, the same indexed bytes mean other fields, and are decoded again."""

    async def run() -> None:
        server = GrpcServer({ECHO: Method(health_pb2.HealthCheckRequest, _chat)})
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        encoder, reference = hpack.Encoder(), hpack.Decoder()
        fields = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/x.Y/Z"),
            (":authority", "epp"),
            ("te", "trailers"),
        ]
        blocks = [encoder.encode(fields), encoder.encode(fields)]  # the second: indexed only
        assert blocks[1] != blocks[0]
        # a block that adds one entry: the second block's indices now point one further
        blocks.append(encoder.encode([("x-moved", "1"), *fields]))
        blocks += [blocks[1], blocks[1]]  # the same bytes again, twice
        paths = []
        for block in blocks:
            decoded = dict(reference.decode(block))
            paths.append(decoded.get(":path", ""))
        assert paths[:3] == ["/x.Y/Z"] * 3 and paths[3] == paths[4] != "/x.Y/Z"
        out = _PREFACE + _frame(_SETTINGS, 0, 0)
        for i, block in enumerate(blocks):
            out += _frame(_HEADERS, 0x5, 2 * i + 1, block)
        writer.write(out)
        messages = {}
        while len(messages) < len(blocks):
            kind, flags, sid, payload = await _read_frame(reader)
            if kind == _HEADERS:
                answer = dict(hpack.Decoder().decode(payload))
                messages[sid] = answer["grpc-message"]
        for i, path in enumerate(paths):
            assert messages[2 * i + 1] == f"unknown method {path}"
        writer.close()
        await server.stop()

    asyncio.run(run())


class _Deferring:
    """A stream handler that echoes each message and leaves its bookkeeping for after the
    answer (``after_answers``), recording whether the answer had gone to the socket then."""

    def __init__(self, call: Call, events: list) -> None:
        self.call = call
        self.events = events

    def on_message(self, msg):
        self.events.append(("message", msg.service))
        self.call.write(health_pb2.HealthCheckRequest(service=msg.service))
        self.call.after_answers(self._after, msg.service)

    def _after(self, text: str) -> None:
        self.events.append(("after", text, not self.call.conn._out))  # answer written?
        if text == "boom":
            raise RuntimeError("bookkeeping's bug")

    def on_end(self) -> None:
        self.events.append(("end",))


def test_after_answers_runs_once_the_answer_is_written_and_before_the_next_message():
    """The EPP's bookkeeping (routing history, metrics) waits until the answer is on the
    wire, and still runs before the connection's next message is handled: messages of two
    streams in one read each get their answer out, then their bookkeeping, in order; a
    failing callback is logged and the calls go on."""

    async def run() -> None:
        events: list = []
        server, reader, writer, encoder = await _stream_server(lambda c: _Deferring(c, events))
        writer.write(
            _PREFACE
            + _frame(_SETTINGS, 0, 0)
            + _frame(_HEADERS, 0x4, 1, _stream_headers(encoder))
            + _frame(_HEADERS, 0x4, 3, _stream_headers(encoder))
            + _frame(_DATA, 0, 1, _grpc_messages("a", "boom"))
            + _frame(_DATA, 0, 3, _grpc_messages("b"))
        )
        assert await _read_answers(reader, 3, 1) == ["b"]
        writer.write(_frame(_DATA, 0, 1, _grpc_messages("c")))
        assert await _read_answers(reader, 1, 1) == ["c"]  # (a, boom came before b)
        for _ in range(100):
            if ("after", "c", True) in events:
                break
            await asyncio.sleep(0.02)
        assert events == [
            ("message", "a"), ("after", "a", True),
            ("message", "boom"), ("after", "boom", True),
            ("message", "b"), ("after", "b", True),
            ("message", "c"), ("after", "c", True),
        ]  # fmt: skip
        writer.close()
        await server.stop()

    asyncio.run(run())


def test_frames_and_messages_cut_anywhere_arrive_whole():
    """Reads that end anywhere (inside a frame's header, its payload, a message's prefix)
    and messages spread over DATA frames or several in one frame: every message reaches the
    handler whole and in order, once, whatever the cuts; the same bytes in one read too."""
    texts = ["a" * 300, "b", "c" * 40_000, "d", "e" * 7]
    stream = _grpc_messages(*texts)
    # DATA frames cut the messages' bytes at odd places: inside a prefix, inside a payload,
    # two messages' ends and starts in one frame
    cuts = [0, 3, 200, 306, 20_000, 40_318, len(stream)]
    frames = b"".join(
        _frame(_DATA, 0, 1, stream[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)
    )

    async def run(piece: int | None) -> None:
        events: list = []
        server, reader, writer, encoder = await _stream_server(lambda c: _Recorder(c, events))
        data = (
            _PREFACE
            + _frame(_SETTINGS, 0, 0)
            + _frame(_HEADERS, 0x4, 1, _stream_headers(encoder))
            + frames
            + _frame(_DATA, 0x1, 1)  # the client's end
        )
        if piece is None:
            writer.write(data)
        else:  # each piece its own read (the server answers between them)
            sizes = [1, piece, 5, 9, 2, piece * 7]
            pos, k = 0, 0
            while pos < len(data):
                step = sizes[k % len(sizes)]
                writer.write(data[pos : pos + step])
                await writer.drain()
                await asyncio.sleep(0.0005)
                pos, k = pos + step, k + 1
        assert await _read_answers(reader, 1, len(texts)) == texts
        while True:
            kind, flags, sid, payload = await _read_frame(reader)
            if kind == _HEADERS and sid == 1:
                assert flags & 0x1 and dict(hpack.Decoder().decode(payload))["grpc-status"] == "0"
                break
        got = [e[2] for e in events if e[1] == "message"]
        assert got == texts and events[-1] == (1, "end", None)
        writer.close()
        await server.stop()

    asyncio.run(run(None))
    asyncio.run(run(13))
    asyncio.run(run(1000))


def test_after_read_runs_after_a_read_that_leaves_no_call_open():
    """The server's ``after_read`` hook (the EPP's garbage collection) runs at quiet moments
    only: after a read that leaves no call open (a collection there delays no call's next
    message), once that read's answers and the call's trailers have gone to the socket; not
    after reads while a call is open."""

    async def run() -> None:
        events: list = []
        server, reader, writer, encoder = await _stream_server(lambda c: _Deferring(c, events))
        written: list[bool] = []

        def after_read() -> None:
            conn = next(iter(server.connections))
            written.append(not conn._out)  # answers and trailers written?
            events.append(("read", server.calls))

        server.after_read = after_read
        writer.write(_PREFACE + _frame(_SETTINGS, 0, 0))  # no call yet: a quiet read
        for _ in range(100):
            if events:
                break
            await asyncio.sleep(0.02)
        assert events == [("read", 0)]
        writer.write(
            _frame(_HEADERS, 0x4, 1, _stream_headers(encoder))
            + _frame(_DATA, 0, 1, _grpc_messages("a", "b"))
        )
        assert await _read_answers(reader, 1, 2) == ["a", "b"]
        writer.write(_frame(_DATA, 0, 1, _grpc_messages("c")))
        assert await _read_answers(reader, 1, 1) == ["c"]
        assert [e for e in events if e[0] == "read"] == [("read", 0)]  # the call is open
        writer.write(_frame(_DATA, 0x1, 1))  # the client's end: the call ends, no call open
        while True:
            kind, flags, sid, payload = await _read_frame(reader)
            if kind == _HEADERS and sid == 1:
                break
        for _ in range(100):
            if len(written) == 2:
                break
            await asyncio.sleep(0.02)
        assert written == [True, True]
        assert events[-3:] == [("after", "c", True), ("end",), ("read", 0)]
        writer.close()
        await server.stop()

    asyncio.run(run())
