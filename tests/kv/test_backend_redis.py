"""The ``redis`` tier against a real Valkey/Redis server: round trips, verification of what
is read back, and faults injected into the server (stopped, restarted, hung with SIGSTOP,
evicting under maxmemory, full, password) — every fault is misses and failed stores, counted,
never an exception or a hang beyond the socket timeout."""

from __future__ import annotations

import os
import struct
import threading
import time

import numpy as np
import pytest

from kvserve.kv.backends import create_backend
from kvserve.kv.backends.chunk_format import HEADER_BYTES, ChunkCodec
from kvserve.kv.backends.redis import RedisBackend, normalize_url, public_url

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB
MODEL = "0123456789abcdef"
LAYOUT = "test:blocks=4,layers=2,kv=2,heads=2,dim=8,bf16"
TIMEOUT = 1.0  # socket_timeout of the fault tests
# One timeout per call (no retry of a timed-out command), with slack for a loaded 2-core box;
# a call that first waits for a pooled connection may take two.
CALL_BOUND = TIMEOUT + 0.7
POOL_WAIT_BOUND = 2 * TIMEOUT + 1.0


def codec(payload_bytes: int = CHUNK, model: str = MODEL, layout: str = LAYOUT) -> ChunkCodec:
    return ChunkCodec(model=model, layout=layout, payload_bytes=payload_bytes)


def chunks(n: int, size: int = CHUNK) -> tuple[list[bytes], list[memoryview]]:
    return [os.urandom(32) for _ in range(n)], [memoryview(os.urandom(size)) for _ in range(n)]


def outs(n: int, size: int = CHUNK) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


def timed(fn, *args):
    t0 = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - t0


# -- options and registry ---------------------------------------------------------------------
def test_registered_as_redis_and_valkey(redis_server):
    c = codec()
    url = redis_server.url.replace("redis://", "valkey://")
    for name in ("redis", "valkey"):
        b = create_backend(name, c, url=url)
        try:
            assert isinstance(b, RedisBackend)
            assert b.shared and b.locality == "REMOTE" and b.medium == "STORAGE"
            assert b.tier_id == f"redis://127.0.0.1:{redis_server.port}/0"
        finally:
            b.close()


def test_url_schemes_and_tier_id():
    assert normalize_url("valkey://h:1/2") == "redis://h:1/2"
    assert normalize_url("valkeys://u:p@h:1") == "rediss://u:p@h:1"
    assert normalize_url("rediss://h") == "rediss://h"
    with pytest.raises(ValueError, match="scheme"):
        normalize_url("http://h:6379")
    # Credentials never name the tier; spellings of one server agree.
    assert public_url("valkey://user:secret@cache.local:7000/3") == "redis://cache.local:7000/3"
    assert public_url("redis://:secret@cache.local") == "redis://cache.local:6379/0"
    assert public_url("valkeys://h") == "rediss://h:6379/0"


def test_tls_options_are_passed_to_tls_connections(tmp_path):
    import redis

    b = RedisBackend(
        codec(),
        url="valkeys://:pw@127.0.0.1:1/0",
        ssl_ca_certs=str(tmp_path / "ca.pem"),
        ssl_certfile=str(tmp_path / "c.pem"),
        ssl_keyfile=str(tmp_path / "c.key"),
        ssl_cert_reqs="required",
        ssl_check_hostname="false",
        socket_timeout="0.3",
    )
    try:
        kw = b._pool.connection_kwargs
        assert b._pool.connection_class is redis.SSLConnection
        assert kw["ssl_ca_certs"] == str(tmp_path / "ca.pem")
        assert kw["ssl_certfile"] == str(tmp_path / "c.pem")
        assert kw["ssl_keyfile"] == str(tmp_path / "c.key")
        assert kw["ssl_cert_reqs"] == "required" and kw["ssl_check_hostname"] is False
        assert kw["password"] == "pw" and kw["socket_timeout"] == 0.3
        assert b.tier_id == "rediss://127.0.0.1:1/0"
    finally:
        b.close()
    with pytest.raises(ValueError, match="rediss://"):
        RedisBackend(codec(), url="redis://127.0.0.1:1", ssl_ca_certs="ca.pem")


# -- round trips ------------------------------------------------------------------------------
def test_round_trip_exists_skip_remove(make_redis_backend, redis_server):
    c = codec()
    b = make_redis_backend(c, ttl="3600")
    keys, payloads = chunks(5)
    assert b.exists(keys) == 0
    assert b.put(keys[:3], payloads[:3]) == [True] * 3
    assert b.stats.written == 3 and b.stats.write_bytes == 3 * c.payload_bytes
    # Leading run only: a hole stops it even when later keys are present.
    assert b.exists(keys) == 3
    assert b.exists([keys[0], keys[3], keys[1]]) == 1
    assert b.stats.lookups == 5 + 5 + 3

    # Present keys are skipped (NX), and still reported as held.
    assert b.put(keys, payloads) == [True] * 5
    assert b.stats.write_skipped == 3 and b.stats.written == 5

    got = outs(5)
    assert b.get(keys, got) == [True] * 5
    assert [bytes(g) for g in got] == [bytes(p) for p in payloads]
    assert b.stats.hits == 5 and b.stats.read_bytes == 5 * c.payload_bytes

    # One value per chunk: header and payload together, under the namespaced key, with the TTL.
    client = redis_server.client()
    rkey = f"kvserve:{c.namespace}:{keys[0].hex()}".encode()
    assert b.server_key(keys[0]) == rkey
    assert client.get(rkey) == c.encode(keys[0], payloads[0])
    assert 0 < client.ttl(rkey) <= 3600

    b.remove(keys[1:3])
    assert b.exists(keys) == 1
    assert b.get(keys[:3], outs(3)) == [True, False, False]
    assert b.stats.misses == 2 and b.stats.corrupt == 0 and b.stats.errors == 0


def test_typed_buffers_and_real_chunk_size(make_redis_backend):
    """Host-memory views are typed (bf16/fp16 tensors): bytes in, same bytes out; 2 MiB."""
    size = 2 * MiB
    b = make_redis_backend(codec(size))
    src = [np.random.default_rng(i).standard_normal(size // 2).astype(np.float16) for i in range(3)]
    keys = [os.urandom(32) for _ in src]
    assert b.put(keys, [memoryview(a) for a in src]) == [True] * 3
    dst = [np.zeros(size // 2, np.float16) for _ in src]
    assert b.get(keys, [memoryview(a) for a in dst]) == [True] * 3
    for s, d in zip(src, dst, strict=True):
        assert np.array_equal(s.view(np.uint16), d.view(np.uint16))


def test_a_store_sends_the_caller_buffer_unjoined(make_redis_backend):
    """A pipelined SET of chunks goes to the socket with each payload as the caller's own
    buffer (a view of it, no copy): redis-py's pipeline keeps such pieces apart, and no piece
    of the packed pipeline is a new object of a chunk's size (a joined header + payload would
    be one more pass over memory per stored byte)."""
    size = 2 * MiB
    b = make_redis_backend(codec(size))
    keys, payloads = chunks(3, size)
    conn = b._pool.get_connection()
    try:
        packed = conn.pack_commands(
            [
                ("SET", b.server_key(k), b._value(k, p, None), "NX")
                for k, p in zip(keys, payloads, strict=True)
            ]
        )
    finally:
        b._pool.release(conn)
    big = [piece for piece in packed if len(piece) >= size]
    assert len(big) == 3 and all(isinstance(piece, memoryview) for piece in big)
    assert [piece.obj for piece in big] == [p.obj for p in payloads]  # the callers' buffers
    assert sum(len(piece) for piece in packed) < 3 * (size + HEADER_BYTES + 200)
    assert b.put(keys, payloads) == [True] * 3
    got = outs(3, size)
    assert b.get(keys, got) == [True] * 3 and [bytes(g) for g in got] == [
        bytes(p) for p in payloads
    ]


def test_models_and_layouts_do_not_see_each_other(make_redis_backend):
    keys, payloads = chunks(2)
    a = make_redis_backend(codec())
    other_model = make_redis_backend(codec(model="fedcba9876543210"))
    other_layout = make_redis_backend(codec(layout=LAYOUT + ",tp=2"))
    assert a.put(keys, payloads) == [True, True]
    assert other_model.exists(keys) == 0 and other_layout.exists(keys) == 0
    assert other_model.get(keys, outs(2)) == [False, False]
    # Same keys written by the others are their own values: no skip, no clobbering.
    assert other_model.put(keys, payloads) == [True, True] and other_model.stats.written == 2
    got = outs(2)
    assert a.get(keys, got) == [True, True] and bytes(got[0]) == bytes(payloads[0])


def test_two_instances_share_and_race_on_one_chunk(make_redis_backend):
    """Several writers of the same chunks at once (two instances, threads): each chunk is
    written once, the others skip, every reader gets intact chunks."""
    c = codec()
    writers = [make_redis_backend(c) for _ in range(2)]
    keys, payloads = chunks(8)
    results: list[list[bool]] = []

    def store(b):
        for _ in range(3):
            results.append(b.put(keys, payloads))

    threads = [threading.Thread(target=store, args=(w,)) for w in writers for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == [True] * 8 for r in results)
    assert sum(w.stats.written for w in writers) == 8
    assert sum(w.stats.write_skipped for w in writers) == 12 * 8 - 8
    reader = make_redis_backend(c)
    got = outs(8)
    assert reader.get(keys, got) == [True] * 8
    assert [bytes(g) for g in got] == [bytes(p) for p in payloads]


# -- verification of what is read ---------------------------------------------------------------
def test_bad_values_are_misses_counted_and_deleted(make_redis_backend, redis_server):
    c = codec()
    b = make_redis_backend(c)
    keys, payloads = chunks(7)
    good = c.encode(keys[0], payloads[0])
    flipped = bytearray(c.encode(keys[1], payloads[1]))
    flipped[HEADER_BYTES + 12345] ^= 0x10
    truncated = c.encode(keys[2], payloads[2])[:-1]
    foreign = codec(model="fedcba9876543210").encode(keys[3], payloads[3])
    stale = bytearray(c.encode(keys[4], payloads[4]))
    struct.pack_into("<H", stale, 4, 0)  # format version 0
    misplaced = c.encode(keys[0], payloads[0])  # another key's chunk
    client = redis_server.client()
    last = c.encode(keys[6], payloads[6])  # read after all the bad ones: replies stay in step
    values = [good, flipped, truncated, foreign, stale, misplaced, last]
    for key, value in zip(keys, values, strict=True):
        client.set(b.server_key(key), bytes(value))

    got = outs(7)
    assert b.get(keys, got) == [True, False, False, False, False, False, True]
    assert bytes(got[0]) == bytes(payloads[0]) and bytes(got[6]) == bytes(payloads[6])
    assert b.stats.corrupt == 5 and b.stats.misses == 5 and b.stats.hits == 2
    assert b.stats.errors == 0
    assert client.exists(*(b.server_key(k) for k in keys[1:6])) == 0
    assert client.exists(b.server_key(keys[0]), b.server_key(keys[6])) == 2
    # Removed, so the next store of those chunks writes them again.
    assert b.put(keys[1:6], payloads[1:6]) == [True] * 5 and b.stats.written == 5
    assert b.get(keys, outs(7)) == [True] * 7


def test_wrong_type_at_a_key_is_an_error_for_that_chunk_only(make_redis_backend, redis_server):
    b = make_redis_backend(codec())
    keys, payloads = chunks(3)
    assert b.put([keys[0], keys[2]], [payloads[0], payloads[2]]) == [True, True]
    redis_server.client().rpush(b.server_key(keys[1]), b"not a chunk")
    got = outs(3)
    assert b.get(keys, got) == [True, False, True]
    assert bytes(got[2]) == bytes(payloads[2])
    assert b.stats.errors == 1 and b.stats.misses == 1
    assert b.exists(keys) == 3  # EXISTS does not look at types; get() still refuses it


@pytest.mark.parametrize("size", [1 * KiB, 100 * KiB])
def test_many_chunks_per_batch(make_redis_backend, size):
    """Small chunks: many replies arrive in one socket read; large: one reply spans reads."""
    b = make_redis_backend(codec(size))
    keys, payloads = chunks(200, size)
    present = [i % 7 != 3 for i in range(200)]
    sel = [i for i in range(200) if present[i]]
    assert all(b.put([keys[i] for i in sel], [payloads[i] for i in sel]))
    got = outs(200, size)
    assert b.get(keys, got) == present
    assert all(bytes(got[i]) == bytes(payloads[i]) for i in sel)
    assert b.stats.errors == 0 and b.stats.corrupt == 0
    # The connection is in step afterwards (the same pooled socket serves the next calls).
    assert b.exists(keys[:3]) == 3 and b.get(keys[:1], outs(1, size)) == [True]


def test_resp3_url(make_redis_backend, redis_server):
    b = make_redis_backend(codec(), url=redis_server.url + "?protocol=3")
    keys, payloads = chunks(3)
    assert b.put(keys[:1], payloads[:1]) == [True]
    assert b.get(keys, outs(3)) == [True, False, False] and b.stats.errors == 0


# -- faults ---------------------------------------------------------------------------------------
def test_server_stopped_then_restarted(redis_server_factory):
    srv = redis_server_factory()
    b = create_backend("redis", codec(), url=srv.url, socket_timeout=TIMEOUT)
    try:
        keys, payloads = chunks(4)
        assert b.put(keys[:2], payloads[:2]) == [True, True]
        srv.stop()
        assert timed(b.exists, keys)[0] == 0
        (ok, dt) = timed(b.get, keys, outs(4))
        assert ok == [False] * 4 and dt < CALL_BOUND
        (ok, dt) = timed(b.put, keys[2:], payloads[2:])
        assert ok == [False, False] and dt < CALL_BOUND
        assert b.stats.errors == 3 and b.stats.misses == 4
        # The server comes back (empty: no persistence); the same backend works again.
        srv.start()
        assert b.put(keys, payloads) == [True] * 4
        got = outs(4)
        assert b.exists(keys) == 4 and b.get(keys, got) == [True] * 4
        assert bytes(got[3]) == bytes(payloads[3])
        assert b.stats.errors == 3
    finally:
        b.close()


def test_server_killed_while_connections_are_pooled(redis_server_factory):
    """A crash (SIGKILL) and restart: the pool's sockets are dead; the next calls reconnect."""
    srv = redis_server_factory()
    b = create_backend("redis", codec(), url=srv.url, socket_timeout=TIMEOUT)
    try:
        keys, payloads = chunks(2)
        # Several pooled connections, left open.
        threads = [threading.Thread(target=b.put, args=(keys, payloads)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        threads = [threading.Thread(target=b.get, args=(keys, outs(2))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        srv.kill()
        srv.start()
        # Reads and writes on the pool's dead sockets: reconnected, nothing lost but the data.
        assert [b.get(keys, outs(2)) for _ in range(4)] == [[False, False]] * 4
        srv.kill()
        srv.start()
        assert [b.put(keys, payloads) for _ in range(4)] == [[True, True]] * 4
        assert b.get(keys, outs(2)) == [True, True] and b.stats.errors == 0
    finally:
        b.close()


def test_hung_server_turns_into_misses_then_recovers(redis_server_factory):
    srv = redis_server_factory()
    b = create_backend("redis", codec(), url=srv.url, socket_timeout=TIMEOUT, max_connections=2)
    try:
        keys, payloads = chunks(4)
        assert b.put(keys, payloads) == [True] * 4
        srv.pause()
        (n, dt) = timed(b.exists, keys)
        assert n == 0 and dt < CALL_BOUND
        (ok, dt) = timed(b.get, keys, outs(4))
        assert ok == [False] * 4 and dt < CALL_BOUND
        new_keys, new_payloads = chunks(4)
        (ok, dt) = timed(b.put, new_keys, new_payloads)
        assert ok == [False] * 4 and dt < CALL_BOUND
        # More threads than connections: those waiting for one are bounded too.
        durations: list[float] = []

        def read():
            ok, dt = timed(b.get, keys, outs(4))
            assert ok == [False] * 4
            durations.append(dt)

        threads = [threading.Thread(target=read) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(durations) == 4 and max(durations) < POOL_WAIT_BOUND
        assert b.stats.errors >= 3 + 4

        srv.resume()
        got = outs(4)
        assert b.get(keys, got) == [True] * 4
        assert [bytes(g) for g in got] == [bytes(p) for p in payloads]
        assert b.put(new_keys, new_payloads) == [True] * 4
    finally:
        srv.resume()
        b.close()


def test_server_eviction_makes_misses_not_torn_chunks(redis_server_factory):
    srv = redis_server_factory(maxmemory="12mb", maxmemory_policy="allkeys-lru")
    b = create_backend("redis", codec(), url=srv.url)
    try:
        keys, payloads = chunks(400)  # 25 MiB of chunks into 12 MB
        for i in range(0, 400, 16):
            assert b.put(keys[i : i + 16], payloads[i : i + 16]) == [True] * 16
        got = outs(400)
        ok = []
        for i in range(0, 400, 16):
            ok += b.get(keys[i : i + 16], got[i : i + 16])
        assert 0 < sum(ok) < 400  # evicted ones are plain misses
        assert all(bytes(got[i]) == bytes(payloads[i]) for i in range(400) if ok[i])
        assert b.stats.corrupt == 0 and b.stats.errors == 0
        assert srv.client().info("stats")["evicted_keys"] > 0
    finally:
        b.close()


def test_full_server_without_eviction_fails_stores(redis_server_factory):
    srv = redis_server_factory(maxmemory="4mb", maxmemory_policy="noeviction")
    b = create_backend("redis", codec(), url=srv.url)
    try:
        keys, payloads = chunks(160)
        ok = []
        for i in range(0, 160, 16):
            ok += b.put(keys[i : i + 16], payloads[i : i + 16])
        assert 0 < sum(ok) < 160  # OOM replies: failed stores, counted, no exception
        assert b.stats.errors == 160 - sum(ok) and b.stats.written == sum(ok)
        held = b.exists(keys)
        assert held == ok.index(False)
        assert b.get(keys[:held], outs(held)) == [True] * held
    finally:
        b.close()


def test_watermark_drops_stores(redis_server_factory):
    srv = redis_server_factory()
    base = srv.client().info("memory")["used_memory"]
    b = create_backend(
        "redis", codec(), url=srv.url, watermark=f"{base + 2 * MiB}B", usage_interval=0.05
    )
    try:
        assert b.usage()[1] == base + 2 * MiB
        keys, payloads = chunks(64)
        for i in range(0, 64, 8):  # 4 MiB: crosses the watermark
            b.put(keys[i : i + 8], payloads[i : i + 8])
        deadline = time.monotonic() + 10
        while not b.over_watermark and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.over_watermark and b.usage()[0] > base + 2 * MiB
        # (A slow machine may have crossed it before the last of those batches: dropped too.)
        written, dropped = b.stats.written, b.stats.dropped
        more_keys, more_payloads = chunks(8)
        assert b.put(more_keys, more_payloads) == [False] * 8
        assert b.stats.dropped == dropped + 8 and b.stats.written == written
        assert b.stats.errors == 0
        assert b.exists(more_keys) == 0
        # Room again (the server evicted, or an operator flushed): stores resume.
        srv.client().flushall()
        deadline = time.monotonic() + 10
        while b.over_watermark and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.put(more_keys, more_payloads) == [True] * 8
    finally:
        b.close()


def test_password(redis_server_factory):
    srv = redis_server_factory(password="s3cret")
    keys, payloads = chunks(2)
    right = create_backend("redis", codec(), url=srv.url)  # redis://:s3cret@host:port/0
    as_option = create_backend(
        "valkey", codec(), url=f"valkey://127.0.0.1:{srv.port}/0", password="s3cret"
    )
    wrong = create_backend("redis", codec(), url=f"redis://127.0.0.1:{srv.port}/0", password="nope")
    missing = create_backend("redis", codec(), url=f"redis://127.0.0.1:{srv.port}/0")
    try:
        assert right.tier_id == as_option.tier_id == wrong.tier_id
        assert right.put(keys, payloads) == [True, True]
        assert as_option.get(keys, outs(2)) == [True, True]
        for b in (wrong, missing):
            assert b.exists(keys) == 0
            assert b.get(keys, outs(2)) == [False, False]
            assert b.put(keys, payloads) == [False, False]
            # A call, or each chunk's error reply (NOAUTH), counts.
            assert b.stats.errors >= 3 and b.stats.misses == 2
        assert right.stats.errors == as_option.stats.errors == 0
    finally:
        for b in (right, as_option, wrong, missing):
            b.close()


def test_wrong_buffer_size_is_refused_before_any_io(make_redis_backend):
    """A buffer of the wrong size would desynchronize the reply stream: refused up front."""
    b = make_redis_backend(codec())
    keys, payloads = chunks(2)
    assert b.put(keys, payloads) == [True, True]
    with pytest.raises(ValueError, match="buffers of"):
        b.get(keys, [memoryview(bytearray(CHUNK)), memoryview(bytearray(CHUNK - 1))])
    assert b.get(keys, outs(2)) == [True, True] and b.stats.errors == 0
