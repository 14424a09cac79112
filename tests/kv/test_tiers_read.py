"""Staging reads from the page cache: how many I/O threads a read from the ``fs`` tier starts
with by default, that each verifies every chunk it reads, and the header check every read
of a storage tier makes."""

from __future__ import annotations

import os
from typing import Any

from kvserve.cpu import usable_cores
from kvserve.kv.backends.chunk_format import HEADER_BYTES, ChunkCodec
from kvserve.kv.offload.storage_worker import ReadItem, read_groups
from tests.kv.test_storage_worker import (  # noqa: F401  (device_fs, make_worker: fixtures)
    CODEC,
    chunks,
    device_fs,
    make_worker,
    recorded_gets,
    wait_result,
)


def test_a_read_from_the_page_cache_takes_two_threads_by_default(
    device_fs: Any,  # noqa: F811  (the fixture)
    make_worker: Any,  # noqa: F811
) -> None:
    """By default a read of chunks the page cache holds runs in two I/O threads (where the
    machine has two cores): a chunk's hash (xxh3, the GIL released) in one thread overlaps the
    next chunk's copy in the other, which one thread cannot do (0.70-0.76 of a plain read with
    one thread on 2 cores, 0.98-1.0 with two). Not more: the copies contend for memory
    bandwidth. A chunk changed in the page cache is still a miss: each thread verifies."""
    w = make_worker([device_fs], io_threads=4)
    expect = min(2, usable_cores())
    assert w.cached_read_threads == expect
    keys, payloads = chunks(16)
    assert device_fs.put(keys, payloads) == [True] * 16
    bad = 11  # one flipped byte in a cached file: its thread must catch it
    path = device_fs.path_of(keys[bad])
    with open(path, "r+b") as f:
        f.seek(CODEC.stored_bytes - 7)
        byte = f.read(1)
        f.seek(CODEC.stored_bytes - 7)
        f.write(bytes([byte[0] ^ 0x10]))
    calls: list[str] = []
    recorded_gets(device_fs, calls, hold_s=0.05)
    outs = [memoryview(bytearray(CODEC.payload_bytes)) for _ in keys]
    res = wait_result(w, w.read([ReadItem(0, k, o) for k, o in zip(keys, outs, strict=True)]))
    assert res.ok == [i != bad for i in range(16)]
    for i in range(16):
        if i != bad:
            assert bytes(outs[i]) == bytes(payloads[i])
    assert len(calls) == len(read_groups(list(range(16)), 4)) == 8
    assert len(set(calls)) == expect, calls


def test_a_header_is_accepted_only_as_this_codec_writes_it() -> None:
    """Reads check every chunk's header against the bytes this codec writes (compared in runs,
    not field by field): any byte changed in the magic, version, layout length, payload
    length, key, model or layout is a rejected header; a changed digest is returned as read
    (the payload's hash then fails); the same fields from another codec are rejected."""
    key, payload = os.urandom(32), os.urandom(CODEC.payload_bytes)
    header = CODEC.header(key, payload)
    digest = header[16:32]
    assert CODEC.check_header(key, header) == digest
    assert CODEC.verify(key, header + payload) is not None
    used = 80 + len(CODEC.layout.encode())  # fixed fields, then the layout (zero padding after)
    for i in range(used):
        bad = bytearray(header)
        bad[i] ^= 0x01
        got = CODEC.check_header(key, bytes(bad))
        if 16 <= i < 32:
            assert got == bytes(bad[16:32]) != digest
            assert CODEC.verify(key, bytes(bad) + payload) is None
        else:
            assert got is None, i
    assert CODEC.check_header(key, header[: HEADER_BYTES - 1]) is None
    assert CODEC.check_header(bytes(32), header) is None
    others = (
        ChunkCodec("fedcba9876543210", CODEC.layout, CODEC.payload_bytes),
        ChunkCodec(CODEC.model, CODEC.layout + "x", CODEC.payload_bytes),
        ChunkCodec(CODEC.model, CODEC.layout, CODEC.payload_bytes + 1),
    )
    for other in others:
        assert other.check_header(key, header) is None
        assert CODEC.check_header(key, other.header(key, os.urandom(other.payload_bytes))) is None
