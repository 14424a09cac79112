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
