"""The StorageBackend contract, run against every storage tier on real media.

Each backend plugs in through a :class:`Harness`: how to make an instance with room for ``n``
chunks, and how to tamper with a stored chunk (its bytes in the codec's order, header then
payload).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import pytest

from kvserve.kv.backends import create_backend
from kvserve.kv.backends.chunk_format import HEADER_BYTES, ChunkCodec
from kvserve.kv.backends.storage import StorageBackend

# fs-python: the fs tier reading each file in Python, where its native group read is not built.
BACKENDS = ["disk", "fs", "fs-python", "redis"]
SHARED_BACKENDS = ["fs", "redis"]  # written by several processes at once
# Tiers that bound their own size; a Redis server evicts by its own policy (test_backend_redis).
SELF_EVICTING = ["disk", "fs"]

MODEL = "0123456789abcdef"
CODEC = ChunkCodec(model=MODEL, layout="L2-B16-H2-D32-bfloat16-k2", payload_bytes=64 << 10)


def keys_and_payloads(n: int, seed: int = 0) -> tuple[list[bytes], list[memoryview]]:
    """``n`` distinct chunk keys and random payloads, reproducible from ``seed``."""
    import random

    rng = random.Random(seed)
    keys = [rng.randbytes(32) for _ in range(n)]
    payloads = [memoryview(rng.randbytes(CODEC.payload_bytes)) for _ in range(n)]
    return keys, payloads


def outs_for(n: int) -> list[memoryview]:
    return [memoryview(bytearray(CODEC.payload_bytes)) for _ in range(n)]


@dataclass
class Harness:
    """How the contract tests make and tamper with one backend."""

    name: str
    options: Callable[[int], dict[str, Any]]  # room for n chunks -> backend options
    tamper: Callable[[Any, bytes, Callable[[bytes], bytes]], None]
    made: list[StorageBackend] = field(default_factory=list)
    python_read: bool = False  # fs: its reads in Python (as without the C extension)

    def make(self, capacity: int = 64, codec: ChunkCodec = CODEC, **extra: Any) -> Any:
        backend = create_backend(self.name, codec, **{**self.options(capacity), **extra})
        if self.python_read:
            backend.native_read = False
        self.made.append(backend)
        return backend


def _tamper_disk(backend: Any, key: bytes, fn: Callable[[bytes], bytes]) -> None:
    slot = backend.slot_of(key)
    assert slot is not None
    n, off = CODEC.payload_bytes, slot * backend.slot_bytes
    fd = os.open(backend.path, os.O_RDWR)
    try:
        payload, header = os.pread(fd, n, off), os.pread(fd, HEADER_BYTES, off + n)
        stored = fn(header + payload).ljust(CODEC.stored_bytes, b"\0")[: CODEC.stored_bytes]
        os.pwrite(fd, stored[HEADER_BYTES:] + stored[:HEADER_BYTES], off)
        os.fsync(fd)
    finally:
        os.close(fd)


def _tamper_fs(backend: Any, key: bytes, fn: Callable[[bytes], bytes]) -> None:
    path = Path(backend.path_of(key))
    path.write_bytes(fn(path.read_bytes()))


def _tamper_redis(backend: Any, key: bytes, fn: Callable[[bytes], bytes]) -> None:
    import redis

    client = redis.Redis.from_url(backend.url)
    try:
        rkey = backend.server_key(key)
        client.set(rkey, fn(client.get(rkey)))
    finally:
        client.close()


def _harness(name: str, request: pytest.FixtureRequest, root: Path) -> Harness:
    if name == "disk":
        slot = -(-CODEC.stored_bytes // 4096) * 4096
        return Harness(
            "disk", lambda n: {"path": str(root / "disk"), "size": f"{n * slot}B"}, _tamper_disk
        )
    if name in ("fs", "fs-python"):
        return Harness(
            "fs",
            lambda n: {"path": str(root / "fs"), "size": f"{n * CODEC.stored_bytes}B"},
            _tamper_fs,
            python_read=name == "fs-python",
        )
    if name == "redis":
        # A server per test; room for n chunks: a watermark above what it holds empty.
        srv = request.getfixturevalue("redis_server_factory")()
        base = srv.client().info("memory")["used_memory"]
        return Harness(
            "redis",
            lambda n: {"url": srv.url, "watermark": f"{base + 2 * n * CODEC.stored_bytes}B"},
            _tamper_redis,
        )
    raise AssertionError(f"no contract harness for {name!r}")


@pytest.fixture
def harness_of(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[str], Harness]]:
    made: list[Harness] = []

    def get(name: str) -> Harness:
        h = _harness(name, request, tmp_path)
        made.append(h)
        return h

    yield get
    for h in made:
        for b in h.made:
            b.close()


@pytest.fixture(params=BACKENDS)
def harness(request: pytest.FixtureRequest, harness_of: Callable[[str], Harness]) -> Harness:
    return harness_of(request.param)


@pytest.fixture
def storage_backend(harness: Harness) -> Any:
    """An instance of each backend, with room for 64 chunks."""
    return harness.make()


# -- round trip, presence, removal ---------------------------------------------------------------
def test_round_trip_and_leading_run(storage_backend: Any) -> None:
    b = storage_backend
    keys, payloads = keys_and_payloads(6)
    assert b.exists(keys) == 0
    assert b.put(keys[:4], payloads[:4]) == [True] * 4
    assert b.exists(keys) == 4
    assert b.exists([keys[0], keys[1], keys[5], keys[2]]) == 2  # the leading run only
    outs = outs_for(6)
    assert b.get(keys, outs) == [True] * 4 + [False] * 2
    for out, p in zip(outs[:4], payloads[:4], strict=True):
        assert bytes(out) == bytes(p)
    s = b.stats
    assert (s.hits, s.misses, s.corrupt, s.errors) == (4, 2, 0, 0)
    assert s.written == 4 and s.write_bytes == 4 * CODEC.payload_bytes
    assert s.read_bytes == 4 * CODEC.payload_bytes
    used, cap = b.usage()
    assert used >= 4 * CODEC.payload_bytes and cap >= used


def test_put_again_is_skipped_and_remove_forgets(storage_backend: Any) -> None:
    b = storage_backend
    keys, payloads = keys_and_payloads(3)
    assert b.put(keys, payloads) == [True] * 3
    assert b.put(keys[:2], payloads[:2]) == [True, True]
    assert b.stats.write_skipped == 2 and b.stats.written == 3
    b.remove([keys[1], b"\x07" * 32])  # an absent key is fine
    assert b.exists(keys) == 1
    assert b.get(keys, outs_for(3)) == [True, False, True]
    assert b.stats.corrupt == 0  # a removed chunk is absent, not bad


def test_put_stores_the_callers_headers(storage_backend: Any) -> None:
    """The storage worker makes each chunk's header (its full-content hash) once for every
    tier: a tier stores the header it is given, never hashing again. A wrong header given is
    stored as is and fails verification on read: a counted miss, never a wrong chunk."""
    b = storage_backend
    keys, payloads = keys_and_payloads(3)
    headers = [CODEC.header(k, p) for k, p in zip(keys, payloads, strict=True)]
    headers[2] = CODEC.header(keys[2], payloads[0])  # the hash of another payload
    assert b.put(keys, payloads, headers) == [True] * 3
    outs = outs_for(3)
    assert b.get(keys, outs) == [True, True, False]
    assert [bytes(o) for o in outs[:2]] == [bytes(p) for p in payloads[:2]]
    assert b.stats.corrupt == 1 and b.exists(keys[2:]) == 0


def test_typed_buffers(storage_backend: Any) -> None:
    """Host-tier slots arrive as memoryviews of any format (torch -> numpy views)."""
    import numpy as np

    b = storage_backend
    keys, payloads = keys_and_payloads(2)
    typed = [memoryview(np.frombuffer(bytes(p), dtype=np.float16)) for p in payloads]
    assert b.put(keys, typed) == [True, True]
    outs = [memoryview(np.zeros(CODEC.payload_bytes // 2, dtype=np.float16)) for _ in keys]
    assert b.get(keys, outs) == [True, True]
    assert [o.tobytes() for o in outs] == [bytes(p) for p in payloads]


# -- verification on read ------------------------------------------------------------------------
def _flip(offset: int) -> Callable[[bytes], bytes]:
    def fn(stored: bytes) -> bytes:
        b = bytearray(stored)
        b[offset] ^= 0x10
        return bytes(b)

    return fn


def _other_header(codec: ChunkCodec) -> Callable[[bytes], bytes]:
    def fn(stored: bytes) -> bytes:
        key = stored[32:64]
        return codec.header(key, stored[HEADER_BYTES:]) + stored[HEADER_BYTES:]

    return fn


def _other_version(stored: bytes) -> bytes:
    b = bytearray(stored)
    struct.pack_into("<H", b, 4, struct.unpack_from("<H", b, 4)[0] + 1)
    return bytes(b)


def _other_key(stored: bytes) -> bytes:
    return CODEC.header(b"\x42" * 32, stored[HEADER_BYTES:]) + stored[HEADER_BYTES:]


TAMPERS: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda s: s[: len(s) // 2],
    "empty": lambda s: b"",
    "payload_bit_flip": _flip(HEADER_BYTES + CODEC.payload_bytes - 7),
    "first_payload_byte": _flip(HEADER_BYTES),
    "hash_bit_flip": _flip(20),
    "other_model": _other_header(ChunkCodec("fedcba9876543210", CODEC.layout, CODEC.payload_bytes)),
    "other_layout": _other_header(
        ChunkCodec(MODEL, "L2-B16-H2-D32-float16-k2", CODEC.payload_bytes)
    ),
    "other_format_version": _other_version,
    "other_key": _other_key,
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_bad_chunk_is_a_counted_miss_and_removed(harness: Harness, tamper: str) -> None:
    b = harness.make()
    keys, payloads = keys_and_payloads(3)
    assert b.put(keys, payloads) == [True] * 3
    harness.tamper(b, keys[1], TAMPERS[tamper])
    outs = outs_for(3)
    assert b.get(keys, outs) == [True, False, True]
    assert b.stats.corrupt == 1 and b.stats.misses == 1 and b.stats.errors == 0
    assert b.exists(keys[1:2]) == 0  # removed from the tier
    assert b.get(keys[1:2], outs_for(1)) == [False]
    assert b.stats.corrupt == 1  # gone, not found bad twice
    # The tier recovers: the chunk can be stored and served again.
    assert b.put(keys[1:2], payloads[1:2]) == [True]
    assert b.get(keys[1:2], outs[1:2]) == [True] and bytes(outs[1]) == bytes(payloads[1])


def test_other_codec_never_sees_the_chunks(harness: Harness) -> None:
    a = harness.make()
    keys, payloads = keys_and_payloads(2)
    assert a.put(keys, payloads) == [True, True]
    other = ChunkCodec("fedcba9876543210", CODEC.layout, CODEC.payload_bytes)
    if not a.shared:
        a.close()  # one instance per private tier: the other model's instance takes it over
    b = harness.make(codec=other)
    assert b.exists(keys) == 0
    assert b.get(keys, outs_for(2)) == [False, False]
    assert b.stats.corrupt == 0  # not even found: another namespace


# -- concurrency ---------------------------------------------------------------------------------
def test_same_chunks_from_threads(storage_backend: Any) -> None:
    b = storage_backend
    keys, payloads = keys_and_payloads(16)
    barrier = threading.Barrier(6)
    results: list[list[bool]] = []

    def writer() -> None:
        barrier.wait()
        results.append(b.put(keys, payloads))

    threads = [threading.Thread(target=writer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [[True] * 16] * 6
    assert b.stats.written + b.stats.write_skipped == 6 * 16
    assert b.stats.written >= 16 and b.stats.errors == 0
    outs = outs_for(16)
    assert b.get(keys, outs) == [True] * 16
    assert [bytes(o) for o in outs] == [bytes(p) for p in payloads]


def _put_from_process(
    name: str, options: dict[str, Any], barrier: Any, rounds: int, q: Any
) -> None:
    backend = create_backend(name, CODEC, **options)
    try:
        ok = True
        for r in range(rounds):
            keys, payloads = keys_and_payloads(8, seed=100 + r)
            barrier.wait(60)
            ok &= backend.put(keys, payloads) == [True] * 8
        q.put((ok, backend.stats.as_dict()))
    finally:
        backend.close()


@pytest.mark.parametrize("name", SHARED_BACKENDS)
def test_same_chunks_from_two_processes(harness_of: Callable[[str], Harness], name: str) -> None:
    h = harness_of(name)
    rounds = 10
    reader = h.make(capacity=2 * rounds * 8)  # room for every chunk: nothing is evicted
    ctx = get_context("spawn")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    options = h.options(2 * rounds * 8)
    procs = [
        ctx.Process(target=_put_from_process, args=(name, options, barrier, rounds, q))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert all(ok for ok, _ in results)
    stats = [s for _, s in results]
    assert sum(s["written"] + s["write_skipped"] for s in stats) == 2 * rounds * 8
    assert sum(s["errors"] for s in stats) == 0
    for r in range(rounds):
        keys, payloads = keys_and_payloads(8, seed=100 + r)
        outs = outs_for(8)
        assert reader.get(keys, outs) == [True] * 8
        assert [bytes(o) for o in outs] == [bytes(p) for p in payloads]
    assert reader.stats.corrupt == 0


# -- capacity and restarts -----------------------------------------------------------------------
@pytest.mark.parametrize("name", SELF_EVICTING)
def test_eviction_keeps_the_tier_within_its_size(
    harness_of: Callable[[str], Harness], name: str
) -> None:
    import time

    b = harness_of(name).make(capacity=8)
    keys, payloads = keys_and_payloads(24)
    for k, p in zip(keys, payloads, strict=True):
        assert b.put([k], [p]) == [True]
    deadline = time.monotonic() + 30  # a shared tier's sweeper runs in the background
    while b.usage()[0] > b.usage()[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    used, cap = b.usage()
    assert 0 < used <= cap <= 8 * CODEC.stored_bytes + 8 * 4096
    assert b.exists(keys[:1]) == 0  # the least recently used went first
    outs = outs_for(1)
    assert b.get(keys[-1:], outs) == [True] and bytes(outs[0]) == bytes(payloads[-1])
    assert b.stats.evicted >= 24 - 8


def test_a_new_instance_keeps_the_chunks(harness: Harness) -> None:
    a = harness.make()
    keys, payloads = keys_and_payloads(5)
    assert a.put(keys, payloads) == [True] * 5
    a.close()
    b = harness.make()  # the same options: a restarted instance, or another one
    assert b.exists(keys) == 5
    outs = outs_for(5)
    assert b.get(keys, outs) == [True] * 5
    assert [bytes(o) for o in outs] == [bytes(p) for p in payloads]
