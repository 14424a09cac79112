"""HTTP/1.1 connection handling of the engine server: uvicorn's httptools protocol, guarded.

uvicorn (httptools) has no header timeout: a connection that sends half a request header is
held until the client goes away, so a few hundred slow clients hold as many sockets and
tasks. And an ``Upgrade: h2c`` request (``curl --http2``) makes llhttp stop parsing after
the headers, so the body of such a POST is lost. This protocol adds:

- a header timeout: from the connection's start, or from a request's first byte, its headers
  must be complete within ``header_timeout`` seconds, else the connection is closed (with a
  408 if a request had begun). Idle keep-alive connections close after uvicorn's
  ``timeout_keep_alive``;
- ignoring protocol upgrades other than WebSocket: the request is served as HTTP/1.1 (as
  RFC 9113 allows: a server may ignore ``Upgrade``), its body parsed by a fresh parser.

:func:`uvicorn_config` builds a uvicorn config with both, from a :class:`ServerConfig`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvserve.config import ServerConfig

# Headers that frame a body: kept when a request is re-parsed without its Upgrade.
_FRAMING = (b"content-length", b"transfer-encoding")


def _timeout_response() -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": "The request header did not arrive in time.",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    return head + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with a header timeout, ignoring non-WebSocket upgrades."""

    def __init__(self, *args: Any, header_timeout: float = 10.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_header = False  # a request's first byte came, its headers not yet
        self._muted = False  # parsing a synthetic request head (see _ignore_upgrade)

    # -- header timeout -------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        if self._header_timer is None and self.header_timeout > 0:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_expired)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._in_header and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(_timeout_response())
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        if self._muted:
            return
        super().on_message_begin()
        self._in_header = True
        self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        if not self._muted:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._muted:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._muted:  # the synthetic head is parsed; the body that follows is real
            self._muted = False
            return
        self._in_header = False
        self._cancel_header_timer()
        super().on_headers_complete()

    # -- upgrades -------------------------------------------------------------------------
    def _ignored_upgrade(self) -> bool:
        return bool(self.parser.should_upgrade()) and not self._should_upgrade()

    def on_message_complete(self) -> None:
        # llhttp completes an upgrade request at the end of its headers (its body belongs
        # to the new protocol); we serve it as HTTP/1.1 and complete it after its body.
        if self._ignored_upgrade():
            return
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade as exc:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                offset = exc.args[0] if exc.args and isinstance(exc.args[0], int) else len(data)
                self._ignore_upgrade(data[offset:])

    def _ignore_upgrade(self, rest: bytes) -> None:
        """Go on as HTTP/1.1: a fresh parser reads the body (framed by a synthetic head with
        the request's own framing headers, its callbacks muted) and whatever follows."""
        framing = [(n, v) for n, v in self.headers if n in _FRAMING]
        if not framing:
            framing = [(b"content-length", b"0")]
        head = b"POST / HTTP/1.1\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in framing)
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self._muted = True
        self._feed(head + b"\r\n" + rest)


def uvicorn_config(app: Any, config: ServerConfig, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config serving ``app`` with the guarded protocol and ``config``'s timeouts."""
    protocol = functools.partial(
        GuardedHttpToolsProtocol, header_timeout=config.timeout_request_header
    )
    return uvicorn.Config(
        app,
        http=protocol,  # type: ignore[arg-type]
        timeout_keep_alive=config.timeout_keep_alive,  # type: ignore[arg-type]
        **kwargs,
    )
