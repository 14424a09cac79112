"""Slow and odd clients on real sockets: header timeout, idle keep-alive timeout, and
``Upgrade: h2c`` (``curl --http2``) served as HTTP/1.1."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from kvserve.config import ServerConfig

HEADER_TIMEOUT = 1.0
KEEP_ALIVE = 1.0


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    from kvserve.engine.engine import LLMEngine

    from .conftest import engine_config, start_server

    cfg = ServerConfig(timeout_request_header=HEADER_TIMEOUT, timeout_keep_alive=KEEP_ALIVE)
    running = start_server(LLMEngine(engine_config(tiny_model_dir)), cfg)
    try:
        yield running
    finally:
        running.stop()


def _addr(served) -> tuple[str, int]:
    host, port = served.base_url.removeprefix("http://").split(":")
    return host, int(port)


def _read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[str, bytes, bytes]:
    """(head, body, bytes read past the body) of one Content-Length response."""
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {buf!r}"
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    return head.decode(), rest[:length], rest[length:]


def _wait_closed(socks: list[socket.socket], deadline: float) -> dict[socket.socket, bytes]:
    """Until every socket is closed by the server (or the deadline): what each received."""
    received = {s: b"" for s in socks}
    open_ = set(socks)
    while open_ and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_), [], [], 0.2)
        for s in ready:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if chunk:
                received[s] += chunk
            else:
                open_.discard(s)
    assert not open_, f"{len(open_)} of {len(socks)} connections still open"
    return received


def test_half_headers_are_dropped_after_the_header_timeout(guarded):
    addr = _addr(guarded)
    start = time.monotonic()
    half = []
    for _ in range(200):
        s = socket.create_connection(addr, timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        half.append(s)
    silent = [socket.create_connection(addr, timeout=10) for _ in range(20)]
    try:
        # Meanwhile a well-behaved client is served.
        with guarded.http() as http:
            assert http.get("/health").status_code == 200
        # Generous for a loaded machine, far below "held until the client gives up".
        received = _wait_closed(half + silent, start + HEADER_TIMEOUT + 15)
        assert all(received[s].startswith(b"HTTP/1.1 408 ") for s in half)
        body = json.loads(received[half[0]].split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout"
        assert all(received[s] == b"" for s in silent)  # nothing begun: closed silently
        with guarded.http() as http:
            assert http.get("/health").status_code == 200
    finally:
        for s in half + silent:
            s.close()


def test_header_trickled_byte_by_byte_is_cut_off(guarded):
    """The timeout bounds the whole header, not the gap between its bytes."""
    with socket.create_connection(_addr(guarded), timeout=10) as s:
        start = time.monotonic()
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            ready, _, _ = select.select([s], [], [], 0.1)
            try:
                if ready and not s.recv(65536):
                    closed = True
                    break
            except ConnectionResetError:
                # The server closed with our later bytes unread: the kernel resets the
                # connection, which can discard its 408 before we read it.
                closed = True
                break
        assert closed and time.monotonic() - start < HEADER_TIMEOUT + 10


def test_idle_keep_alive_connection_is_closed(guarded):
    with socket.create_connection(_addr(guarded), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head, body, _ = _read_response(s)
        assert head.startswith("HTTP/1.1 200") and json.loads(body) == {"status": "ok"}
        # Kept alive: a second request on the same connection.
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(s)[0].startswith("HTTP/1.1 200")
        start = time.monotonic()
        # Closed after our KEEP_ALIVE (uvicorn's default alone would wait 5 s).
        _wait_closed([s], start + KEEP_ALIVE + 3.5)
        assert time.monotonic() - start >= KEEP_ALIVE * 0.9


def test_h2c_upgrade_is_ignored_and_served_as_http11(guarded):
    """``curl --http2`` on cleartext asks to upgrade; the request (and its body) is served as
    HTTP/1.1 and the connection stays usable."""
    body = json.dumps(
        {"model": guarded.model, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    ).encode()
    upgrade = (
        b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
    )
    with socket.create_connection(_addr(guarded), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + upgrade
            + b"Content-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        head, resp, _ = _read_response(s, 30)
        assert head.startswith("HTTP/1.1 200"), (head, resp)
        assert json.loads(resp)["choices"][0]["finish_reason"] == "length"
        # Chunked body with the upgrade, then a GET with the upgrade, same connection.
        chunked = hex(len(body))[2:].encode() + b"\r\n" + body + b"\r\n0\r\n\r\n"
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            + upgrade
            + b"\r\n"
            + chunked
        )
        head, resp, _ = _read_response(s, 30)
        assert head.startswith("HTTP/1.1 200"), (head, resp)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + upgrade + b"\r\n")
        head, resp, _ = _read_response(s)
        assert head.startswith("HTTP/1.1 200") and json.loads(resp) == {"status": "ok"}
    guarded.wait_idle()
