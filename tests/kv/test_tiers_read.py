"""Staging reads from the page cache: how many I/O threads a read from the ``fs`` tier starts
with by default, and that each verifies every chunk it reads."""

from __future__ import annotations

from typing import Any

from kvserve.cpu import usable_cores
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
