"""The storage worker on real tiers (disk and fs in a temporary directory, Redis on a real
Valkey server): one hash per chunk for all tiers, staging reads in groups of contiguous chunks
read in the I/O threads themselves, writers under SCHED_IDLE, held while paused and to their
duty cycle."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.kv.backends import chunk_format, create_backend
from kvserve.kv.backends.chunk_format import ChunkCodec
from kvserve.kv.offload.storage_worker import ReadItem, StorageResult, StorageWorker, read_groups
from tests.kv.conftest import drop_cached

CODEC = ChunkCodec(
    model="0123456789abcdef", layout="L2-B16-H2-D32-bfloat16-k2", payload_bytes=1 << 16
)
TIMEOUT = 60.0  # generous: a loaded 2-core CI machine


def chunks(n: int, seed: int = 0) -> tuple[list[bytes], list[memoryview]]:
    import random

    rng = random.Random(seed)
    keys = [rng.randbytes(32) for _ in range(n)]
    return keys, [memoryview(rng.randbytes(CODEC.payload_bytes)) for _ in range(n)]


@pytest.fixture
def tiers(tmp_path: Path, make_redis_backend: Callable[..., Any]) -> Iterator[list[Any]]:
    """disk, fs and redis tiers (room for 64 chunks each), closed by the worker or here."""
    made = [
        create_backend("disk", CODEC, path=str(tmp_path / "disk"), size="8MiB"),
        create_backend("fs", CODEC, path=str(tmp_path / "fs"), size="8MiB"),
        make_redis_backend(CODEC),
    ]
    yield made
    for t in made[:2]:
        t.close()


@pytest.fixture
def make_worker() -> Iterator[Callable[..., StorageWorker]]:
    workers: list[StorageWorker] = []

    def make(tiers: list[Any], **kw: Any) -> StorageWorker:
        w = StorageWorker(tiers, **kw)
        workers.append(w)
        return w

    yield make
    for w in workers:
        w._reads.shutdown(wait=True)
        w._writes.shutdown(wait=True)


def wait_result(w: StorageWorker, op: int) -> StorageResult:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        for r in w.poll():
            if r.op_id == op:
                return r
        w.wait_any(0.05)
    raise AssertionError(f"storage op {op} did not finish in {TIMEOUT} s")


def test_read_groups() -> None:
    assert read_groups(list(range(10)), 4) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert read_groups(list(range(62)), 4) == [
        list(range(i, min(62, i + 8))) for i in range(0, 62, 8)
    ]
    assert read_groups([5], 4) == [[5]] and read_groups([], 4) == []
    assert max(map(len, read_groups(list(range(1000)), 4))) == 16


def test_one_hash_per_chunk_for_all_tiers(tiers, make_worker, monkeypatch) -> None:
    """A cascade write of n chunks into three tiers hashes each payload once (not once per
    tier), and every tier serves the chunks back verified."""
    hashed: list[int] = []
    digest = chunk_format.payload_digest

    def counting(payload: Any) -> bytes:
        hashed.append(len(payload))
        return digest(payload)

    monkeypatch.setattr(chunk_format, "payload_digest", counting)  # what header() hashes with
    w = make_worker(tiers)
    keys, payloads = chunks(6)
    res = wait_result(w, w.write(keys, payloads))
    assert res.ok == [True] * 6 and all(res.stored[t] == keys for t in range(3))
    assert len(hashed) == 6
    for tier in tiers:
        outs = [memoryview(bytearray(CODEC.payload_bytes)) for _ in keys]
        assert tier.get(keys, outs) == [True] * 6
        assert [bytes(o) for o in outs] == [bytes(p) for p in payloads]


def test_staging_read_in_groups_in_the_io_threads(tiers, make_worker) -> None:
    """A read of 10 chunks of each tier is one get() call per group of 2 contiguous chunks,
    each read in the I/O thread that called it: the disk and fs tiers start no threads."""
    disk, fs, redis = tiers
    w = make_worker(tiers, io_threads=4)
    keys, payloads = chunks(30)
    for t, tier in enumerate(tiers):
        assert tier.put(keys[10 * t : 10 * t + 10], payloads[10 * t : 10 * t + 10]) == [True] * 10
    calls: list[tuple[str, list[bytes], str]] = []
    for tier in tiers:
        get = tier.get

        def recording(ks, outs, tier=tier, get=get, **kw):
            calls.append((tier.name, list(ks), threading.current_thread().name))
            return get(ks, outs, **kw)

        tier.get = recording
    before = {t.name for t in threading.enumerate()}
    outs = [memoryview(bytearray(CODEC.payload_bytes)) for _ in keys]
    items = [ReadItem(i // 10, k, o) for i, (k, o) in enumerate(zip(keys, outs, strict=True))]
    res = wait_result(w, w.read(items))
    assert res.ok == [True] * 30 and res.nbytes == 30 * CODEC.payload_bytes
    assert [bytes(o) for o in outs] == [bytes(p) for p in payloads]
    for t, tier in enumerate(tiers):
        shards = [ks for name, ks, _ in calls if name == tier.name]
        mine = keys[10 * t : 10 * t + 10]
        assert sorted(shards) == sorted(mine[i : i + 2] for i in range(0, 10, 2))
    assert all(th.startswith("kv-storage-io") for _, _, th in calls)
    started = {t.name for t in threading.enumerate()} - before
    assert not [n for n in started if not n.startswith("kv-storage-io")], started


@pytest.fixture
def device_fs(device_dir: Path) -> Iterator[Any]:
    """An fs tier whose chunks' pages :func:`drop_cached` can drop."""
    fs = create_backend("fs", CODEC, path=str(device_dir), size="8MiB", sweep=False)
    yield fs
    fs.close()


def recorded_gets(tier: Any, calls: list[str], hold_s: float) -> None:
    """Make ``tier.get`` note its thread and hold that thread ``hold_s`` after each call (a
    slow read: the other I/O threads, if started, take the next groups meanwhile)."""
    get = tier.get

    def recording(ks, outs, **kw):
        calls.append(threading.current_thread().name)
        try:
            return get(ks, outs, **kw)
        finally:
            time.sleep(hold_s)

    tier.get = recording


def test_a_read_from_the_page_cache_takes_one_thread(device_fs, make_worker) -> None:
    """With ``cached_read_threads=1``, chunks just written (in the page cache) are read by one
    I/O thread, group after group, however slow each group is (the default on two cores is two
    threads, one hashing while the other copies: ``test_tiers_read.py``)."""
    w = make_worker([device_fs], io_threads=4, cached_read_threads=1)
    keys, payloads = chunks(16)
    assert device_fs.put(keys, payloads) == [True] * 16
    calls: list[str] = []
    recorded_gets(device_fs, calls, hold_s=0.05)
    outs = [memoryview(bytearray(CODEC.payload_bytes)) for _ in keys]
    res = wait_result(w, w.read([ReadItem(0, k, o) for k, o in zip(keys, outs, strict=True)]))
    assert res.ok == [True] * 16 and [bytes(o) for o in outs] == [bytes(p) for p in payloads]
    assert len(calls) == len(read_groups(list(range(16)), 4)) == 8
    assert len(set(calls)) == 1, calls


def test_a_read_that_waits_on_the_device_spreads(device_fs, make_worker) -> None:
    """Chunks no longer cached: the first read that waits on the device starts the other I/O
    threads, which take the remaining groups."""
    w = make_worker([device_fs], io_threads=4, cached_read_threads=1)
    keys, payloads = chunks(16)
    assert device_fs.put(keys, payloads) == [True] * 16
    drop_cached(device_fs, keys)
    calls: list[str] = []
    recorded_gets(device_fs, calls, hold_s=0.2)
    outs = [memoryview(bytearray(CODEC.payload_bytes)) for _ in keys]
    res = wait_result(w, w.read([ReadItem(0, k, o) for k, o in zip(keys, outs, strict=True)]))
    assert res.ok == [True] * 16 and [bytes(o) for o in outs] == [bytes(p) for p in payloads]
    assert len(calls) == 8 and len(set(calls)) > 1, calls


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_fs_read_continues_after_the_cached_part(device_fs, native: bool) -> None:
    """The fs tier reads what the page cache holds without waiting, says so once per call
    before waiting for the rest, and verifies the whole chunk either way: fully cached chunks
    never call ``on_wait``; a file with only its first page cached is read whole (the header
    from the cache, the payload from the device); a bit flipped in the uncached part is a
    miss. Both read paths: the native group read and the one in Python."""
    device_fs.native_read = native
    keys, payloads = chunks(3)
    assert device_fs.put(keys, payloads) == [True] * 3
    waits: list[int] = []
    outs = [memoryview(bytearray(CODEC.payload_bytes)) for _ in keys]
    assert device_fs.get(keys, outs, on_wait=lambda: waits.append(1)) == [True] * 3
    assert not waits and [bytes(o) for o in outs] == [bytes(p) for p in payloads]
    path = device_fs.path_of(keys[2])
    with open(path, "r+b") as f:
        f.seek(chunk_format.HEADER_BYTES + CODEC.payload_bytes - 100)
        f.write(bytes([f.read(1)[0] ^ 0x10]))
    drop_cached(device_fs, keys)
    for k in keys:  # the first page back in the cache: header and the payload's start
        fd = os.open(device_fs.path_of(k), os.O_RDONLY)
        assert os.pread(fd, 4096, 0)
        os.close(fd)
    outs = [memoryview(bytearray(CODEC.payload_bytes)) for _ in keys]
    assert device_fs.get(keys, outs, on_wait=lambda: waits.append(1)) == [True, True, False]
    assert len(waits) == 1
    assert [bytes(o) for o in outs[:2]] == [bytes(p) for p in payloads[:2]]
    assert device_fs.stats.corrupt == 1 and not os.path.exists(path)


def test_writers_run_under_sched_idle(tiers, make_worker) -> None:
    """Writes run on cores the engine leaves idle: the writer threads' policy is SCHED_IDLE."""
    fs = tiers[1]
    policies: list[int] = []
    put = fs.put

    def recording(*a: Any) -> list[bool]:
        policies.append(os.sched_getscheduler(0))
        return put(*a)

    fs.put = recording
    w = make_worker([fs], write_batch=2)
    keys, payloads = chunks(4)
    assert wait_result(w, w.write(keys, payloads)).ok == [True] * 4
    assert policies == [os.SCHED_IDLE] * 2


def test_paused_writes_wait_for_resume(tiers, make_worker) -> None:
    """While the engine computes a step (paused), a queued write does not start; it runs once
    writes resume."""
    fs = tiers[1]
    w = make_worker([fs])
    keys, payloads = chunks(2)
    w.pause_writes()
    op = w.write(keys, payloads)
    time.sleep(0.3)
    assert fs.exists(keys) == 0 and not w.poll()
    w.resume_writes()
    assert wait_result(w, op).ok == [True, True] and fs.exists(keys) == 2


def test_duty_cycle_spaces_the_writes(tiers, make_worker) -> None:
    """Held to a duty cycle of 1/4, writers idle three times as long as each batch took."""
    disk = tiers[0]
    w = make_worker([disk], write_batch=1, write_duty=0.25)
    keys, payloads = chunks(8)
    t0 = time.perf_counter()
    assert wait_result(w, w.write(keys, payloads)).ok == [True] * 8
    wall = time.perf_counter() - t0
    busy = disk.stats.write_s  # the puts alone (the worker's own measure includes the header)
    assert wall >= busy + 3 * busy * 7 / 8 * 0.9, (wall, busy)


def test_bad_settings_are_refused(tiers) -> None:
    with pytest.raises(ValueError, match="writer_policy"):
        StorageWorker(tiers[:1], writer_policy="fast")
    with pytest.raises(ValueError, match="write_duty"):
        StorageWorker(tiers[:1], write_duty=0.0)


def test_a_write_that_raises_leaves_the_pending_count(tiers, make_worker, monkeypatch) -> None:
    """A tier bug mid-write is a miss for those chunks and gives their room in the write
    queue back: before, the pending count kept them forever and, once full, every later
    write was dropped."""
    fs = tiers[1]
    w = make_worker([fs], max_pending_writes=4)

    def broken_put(*args: Any, **kwargs: Any) -> list[bool]:
        raise RuntimeError("tier bug")

    monkeypatch.setattr(fs, "put", broken_put)
    keys, payloads = chunks(4)
    assert wait_result(w, w.write(keys, payloads)).ok == []
    monkeypatch.undo()
    op = w.write(keys, payloads)
    assert op is not None, "the failed write's chunks still count against the queue"
    assert wait_result(w, op).ok == [True] * 4 and fs.exists(keys) == 4
