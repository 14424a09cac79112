"""The Redis/Valkey tier: one value per chunk on a server that several instances share.

Owns the key scheme (``kvserve:<codec namespace>:<chunk key hex>``), the stored value (the
chunk's header and payload as ONE value, so the server's own eviction drops whole chunks and a
reader never sees half of one), batched pipelined reads and writes (non-transactional), the
client-side watermark, and turning every server fault into misses and failed writes.

Connections, authentication, TLS and commands go through redis-py's pool; the two bulk paths
move chunk bytes once: a store sends the header and the caller's payload buffer as one value
(no joined copy), a read receives each value straight into the caller's buffer (redis-py's
Python parser would copy it three times) and verifies it there.

Options (a ``redis:`` or ``valkey:`` tier spec): ``url`` (``redis://``, ``rediss://`` and
their ``valkey://`` / ``valkeys://`` spellings, ``unix://``; credentials in the URL or as
``username`` / ``password``), TLS (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_cert_reqs``, ``ssl_check_hostname``, with a ``rediss://`` URL), ``socket_timeout``
(seconds, default 2: a hung server turns into misses after it), ``max_connections``,
``watermark`` (a size: above this ``used_memory`` on the server, stores are dropped, counted in
``dropped``; capacity is otherwise the server's ``maxmemory`` and its eviction policy), ``ttl``
(seconds a chunk lives; default: until the server evicts it), ``usage_interval`` (seconds
between background reads of the server's memory, default 1; the first is made when the tier is
created, which therefore waits at most ``socket_timeout`` for a hung server).

Faults: a refused or reset connection, a timeout, an OOM reply are counted in ``errors`` and
are misses / failed writes; redis-py's pool reconnects on the next call once the server is back.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import Encoder, PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.retry import Retry

from kvserve.kv.backends import register_backend
from kvserve.kv.backends.chunk_format import HEADER_BYTES, ChunkCodec, payload_digest
from kvserve.kv.backends.storage import StorageBackend, parse_flag, parse_size

KEY_PREFIX = "kvserve"
# Scheme of the URL -> redis-py's scheme.
_SCHEMES = {
    "redis": "redis",
    "rediss": "rediss",
    "valkey": "redis",
    "valkeys": "rediss",
    "unix": "unix",
}
_TLS_OPTIONS = (
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
)
_IO_ERRORS = (RedisError, OSError)
# Bytes per recv() of a reply: chunks are megabytes, redis-py's default (64 KiB) costs a
# Python-level loop iteration per 64 KiB.
_SOCKET_READ_SIZE = 1 << 20


def normalize_url(url: str) -> str:
    """The URL with redis-py's scheme (``valkey://`` -> ``redis://``, ``valkeys://`` ->
    ``rediss://``); ValueError for anything else."""
    parts = urlsplit(url)
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ValueError(
            f"redis tier URL {url!r}: scheme must be one of "
            f"{', '.join(s + '://' for s in _SCHEMES)}"
        )
    return urlunsplit((scheme, *parts[1:]))


def public_url(url: str) -> str:
    """The server's address without credentials (the tier's id: instances sharing one server
    agree on it whatever spelling and password they use)."""
    parts = urlsplit(normalize_url(url))
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    host = parts.hostname or "localhost"
    port = parts.port or 6379
    db = parts.path.strip("/") or "0"
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{port}/{db}"


def _byte_view(buf: memoryview) -> memoryview:
    """A flat unsigned-byte view of a (C-contiguous) buffer."""
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


class _ReplyReader:
    """Reads RESP replies of GETs straight into their destinations with ``recv_into``.

    redis-py's pure-Python parser copies a bulk reply three times (socket -> BytesIO -> bytes ->
    slice); here the payload goes from the socket into the caller's host memory once. Used on a
    connection the pool handed out ready (nothing pending), whose replies are all read here.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(64 * 1024)
        self._view = memoryview(self._buf)
        self._start = self._end = 0

    @property
    def pending(self) -> int:
        """Bytes read past the last reply consumed."""
        return self._end - self._start

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start
            self._view[:n] = self._view[self._start : self._end]
            self._start, self._end = 0, n
        got = self._sock.recv_into(self._view[self._end :])
        if not got:
            raise RedisConnectionError("connection closed by the server")
        self._end += got

    def line(self) -> bytes:
        """One ``\\r\\n``-terminated line, without the terminator."""
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                out = bytes(self._view[self._start : i])
                self._start = i + 2
                return out
            if self._end - self._start >= len(self._buf):
                raise RedisError("reply line too long")
            self._fill()

    def read_into(self, dest: memoryview) -> None:
        """Exactly ``len(dest)`` bytes into ``dest`` (a flat byte view)."""
        have = min(self._end - self._start, len(dest))
        dest[:have] = self._view[self._start : self._start + have]
        self._start += have
        pos = have
        while pos < len(dest):
            got = self._sock.recv_into(dest[pos:])
            if not got:
                raise RedisConnectionError("connection closed by the server")
            pos += got

    def skip(self, n: int) -> None:
        while n > 0:
            if self._start == self._end:
                self._fill()
            step = min(n, self._end - self._start)
            self._start += step
            n -= step


class _StoredChunk:
    """A chunk value as its two pieces (header, payload view): sent as ONE bulk string without
    joining them, so a store neither copies nor allocates the payload."""

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload


class _CommandPacker:
    """redis-py's RESP packing, except that a :class:`_StoredChunk` argument becomes one bulk
    string written from its two buffers (redis-py sends memoryview pieces as they are)."""

    def __init__(self) -> None:
        self._encode = Encoder("utf-8", "strict", False).encode
        self._default = PythonRespSerializer(6000, self._encode)

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if not any(type(a) is _StoredChunk for a in args):
            return self._default.pack(*args)
        out: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
        for arg in args:
            if type(arg) is _StoredChunk:
                size = len(arg.header) + arg.payload.nbytes
                out += [b"$%d\r\n" % size + arg.header, arg.payload, b"\r\n"]
            else:
                enc = self._encode(arg)
                out.append(b"$%d\r\n%s\r\n" % (len(enc), enc))
        return out


@register_backend("valkey")
@register_backend("redis")
class RedisBackend(StorageBackend):
    """Chunks as values on a Redis/Valkey server, shared by every instance that uses it."""

    name = "redis"
    locality = "REMOTE"
    shared = True

    def __init__(
        self,
        codec: ChunkCodec,
        *,
        tier_id: str | None = None,
        url: str = "redis://127.0.0.1:6379/0",
        username: str | None = None,
        password: str | None = None,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_cert_reqs: str | None = None,
        ssl_check_hostname: bool | str | None = None,
        socket_timeout: float | str = 2.0,
        connect_timeout: float | str | None = None,
        max_connections: int | str = 16,
        watermark: int | str | None = None,
        ttl: float | str | None = None,
        usage_interval: float | str = 1.0,
    ) -> None:
        super().__init__(codec, tier_id=tier_id or public_url(url))
        self.url = normalize_url(url)
        self.socket_timeout = float(socket_timeout)
        self.watermark = parse_size(watermark) if watermark not in (None, "", 0, "0") else 0
        self.ttl = int(float(ttl)) if ttl not in (None, "", 0, "0") else None
        if self.ttl is not None and self.ttl <= 0:
            raise ValueError(f"redis tier ttl must be positive seconds, got {ttl!r}")
        self._usage_interval = float(usage_interval)

        kwargs: dict[str, Any] = {
            "max_connections": int(max_connections),
            # Waiting for a free connection is bounded like any other I/O.
            "timeout": self.socket_timeout,
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": float(connect_timeout or self.socket_timeout),
            "socket_keepalive": True,
            "socket_read_size": _SOCKET_READ_SIZE,
            # One immediate retry on a broken connection (a pooled socket the server closed
            # when it restarted); none on a timeout: a hung server must cost one timeout.
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            "driver_info": None,  # no CLIENT SETINFO round trips on every connect
            "command_packer": _CommandPacker(),  # stateless, shared by the connections
            # RESP2: no push messages between replies (redis-py 8 defaults to RESP3, where
            # the pool also stops checking that a connection has nothing pending).
            "protocol": 2,
        }
        if username is not None:
            kwargs["username"] = username
        if password is not None:
            kwargs["password"] = password
        tls = {
            "ssl_ca_certs": ssl_ca_certs,
            "ssl_certfile": ssl_certfile,
            "ssl_keyfile": ssl_keyfile,
            "ssl_cert_reqs": ssl_cert_reqs,
            "ssl_check_hostname": (
                None
                if ssl_check_hostname is None
                else parse_flag(ssl_check_hostname or False, "redis tier: ssl_check_hostname")
            ),
        }
        tls = {k: v for k, v in tls.items() if v is not None}
        if tls and not self.url.startswith("rediss://"):
            raise ValueError(
                f"redis tier: TLS options {sorted(tls)} need a rediss:// or valkeys:// URL"
            )
        kwargs.update(tls)
        self._pool = redis.BlockingConnectionPool.from_url(self.url, **kwargs)
        self._client = redis.Redis(connection_pool=self._pool)
        self._prefix = f"{KEY_PREFIX}:{codec.namespace}:".encode()

        # Server memory, refreshed in the background (never on a caller's path).
        self.used_memory = 0
        self.maxmemory = 0
        self.over_watermark = False
        self._closed = threading.Event()
        self.refresh_usage()  # known from the start; then every usage_interval
        self._monitor = threading.Thread(
            target=self._watch_memory, name=f"kvserve-{self.name}-usage", daemon=True
        )
        self._monitor.start()

    # -- keys and values ---------------------------------------------------------------------
    def server_key(self, key: bytes) -> bytes:
        """The Redis key of chunk ``key``."""
        return self._prefix + key.hex().encode()

    def _value(self, key: bytes, payload: memoryview, header: bytes | None) -> _StoredChunk:
        """Header + payload, sent as one value straight from the caller's buffer."""
        payload = _byte_view(payload)
        return _StoredChunk(header or self.codec.header(key, payload), payload)

    # -- the I/O ------------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.server_key(key))
            replies = pipe.execute()
        except _IO_ERRORS:
            self.count(lookups=len(keys), errors=1)
            return 0
        run = 0
        for present in replies:
            if not present:
                break
            run += 1
        self.count(lookups=len(keys))
        return run

    def get(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[bool]:
        n = len(keys)
        ok = [False] * n
        if not n:
            return ok
        views = [_byte_view(out) for out in outs]
        if len(views) != n or any(v.nbytes != self.codec.payload_bytes for v in views):
            raise ValueError(f"get() needs {n} buffers of {self.codec.payload_bytes} bytes")
        t0 = time.perf_counter()
        try:
            bad, failed, nbytes = self._read(keys, views, ok)
        except _IO_ERRORS:
            ok = [False] * n
            self.count(misses=n, errors=1, read_s=time.perf_counter() - t0)
            return ok
        hits = sum(ok)
        self.count(
            hits=hits,
            misses=n - hits,
            corrupt=len(bad),
            errors=failed,
            read_bytes=nbytes,
            read_s=time.perf_counter() - t0,
        )
        if bad:
            self.remove(bad)
        return ok

    def _read(
        self, keys: Sequence[bytes], outs: Sequence[memoryview], ok: list[bool]
    ) -> tuple[list[bytes], int, int]:
        """Pipelined GETs read into ``outs``, verified; (bad keys, error replies, payload
        bytes served)."""
        codec = self.codec
        stored = codec.stored_bytes
        header = bytearray(HEADER_BYTES)
        header_view = memoryview(header)
        bad: list[bytes] = []
        failed = nbytes = 0
        conn = self._pool.get_connection()
        try:
            conn.send_packed_command(
                conn.pack_commands([(b"GET", self.server_key(k)) for k in keys])
            )
            reader = _ReplyReader(conn._sock)
            for i, key in enumerate(keys):
                line = reader.line()
                if line[:1] == b"-":  # an error reply (e.g. a non-string value there)
                    failed += 1
                    continue
                if line == b"_":  # RESP3 null (a protocol=3 URL): absent
                    continue
                if line[:1] != b"$" or not line[1:].lstrip(b"-").isdigit():
                    raise RedisError(f"unexpected reply to GET: {line[:40]!r}")
                size = int(line[1:])
                if size < 0:  # absent (never written, evicted, expired)
                    continue
                if size != stored:  # truncated, or not one of ours
                    reader.skip(size + 2)
                    bad.append(key)
                    continue
                out = outs[i]
                reader.read_into(header_view)
                reader.read_into(out)
                reader.skip(2)
                digest = codec.check_header(key, header)
                if digest is None or payload_digest(out) != digest:
                    bad.append(key)
                else:
                    ok[i] = True
                    nbytes += codec.payload_bytes
            if reader.pending:  # not a reply we asked for: do not hand the socket on
                conn.disconnect()
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._pool.release(conn)
        return bad, failed, nbytes

    def put(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        headers: Sequence[bytes] | None = None,
    ) -> list[bool]:
        n = len(keys)
        done = [False] * n
        if not n:
            return done
        if self.over_watermark:
            self.count(dropped=n)
            return done
        t0 = time.perf_counter()
        try:
            pipe = self._client.pipeline(transaction=False)
            for i, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
                value = self._value(key, payload, headers and headers[i])
                pipe.set(self.server_key(key), value, nx=True, ex=self.ttl)
            replies = pipe.execute(raise_on_error=False)
        except _IO_ERRORS:
            self.count(errors=1, write_s=time.perf_counter() - t0)
            return done
        written = skipped = errors = 0
        for i, reply in enumerate(replies):
            if isinstance(reply, Exception):  # e.g. OOM under maxmemory with noeviction
                errors += 1
            elif reply:
                written += 1
                done[i] = True
            else:  # NX: another instance (or an earlier store) holds it already
                skipped += 1
                done[i] = True
        self.count(
            written=written,
            write_bytes=written * self.codec.payload_bytes,
            write_s=time.perf_counter() - t0,
            write_skipped=skipped,
            errors=errors,
        )
        return done

    def remove(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        try:
            self._client.delete(*(self.server_key(k) for k in keys))
        except _IO_ERRORS:
            self.count(errors=1)

    def usage(self) -> tuple[int, int]:
        """(server ``used_memory``, the watermark or else the server's ``maxmemory``), as of
        the last background check (at most ``usage_interval`` old while the server answers)."""
        return self.used_memory, self.watermark or self.maxmemory

    def refresh_usage(self) -> None:
        """Read the server's memory now (INFO memory); errors leave the last values."""
        try:
            info = self._client.info("memory")
        except _IO_ERRORS:
            return
        self.used_memory = int(info.get("used_memory", 0))
        self.maxmemory = int(info.get("maxmemory", 0))
        self.over_watermark = bool(self.watermark) and self.used_memory > self.watermark

    def _watch_memory(self) -> None:
        while not self._closed.wait(self._usage_interval):
            self.refresh_usage()

    def close(self) -> None:
        self._closed.set()
        self._monitor.join(timeout=self.socket_timeout + 1.0)
        with contextlib.suppress(Exception):
            self._pool.disconnect()
