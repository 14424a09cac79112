"""The ``fs`` tier on real file systems: file layout, atomic publication under concurrent
readers, cross-process sharing, retention sweeps, and faults (full file system, file-size
limit, permission denied) with recovery."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import threading
import time
from pathlib import Path

import pytest

from kvserve.kv.backends import create_backend
from kvserve.kv.backends.chunk_format import ChunkCodec
from kvserve.kv.backends.fs import FsBackend
from tests.kv.conftest import drop_privileges, in_subprocess, remount
from tests.kv.test_backend_disk import o_direct_works

CODEC = ChunkCodec("0123456789abcdef", "L2-B16-H2-D32-bfloat16-k2", payload_bytes=64 << 10)
STORED = CODEC.stored_bytes


def chunks(n: int, seed: int = 0) -> tuple[list[bytes], list[memoryview]]:
    import random

    rng = random.Random(seed)
    keys = [rng.randbytes(32) for _ in range(n)]
    return keys, [memoryview(rng.randbytes(CODEC.payload_bytes)) for _ in range(n)]


def outs_for(n: int) -> list[memoryview]:
    return [memoryview(bytearray(CODEC.payload_bytes)) for _ in range(n)]


def files(root: Path) -> tuple[list[Path], list[Path]]:
    """(chunk files, temporary files) under a tier root."""
    everything = [p for p in root.rglob("*") if p.is_file()]
    return (
        sorted(p for p in everything if p.suffix == ".kvc"),
        sorted(p for p in everything if p.name.startswith(".tmp-")),
    )


@pytest.fixture
def make(tmp_path: Path):
    made: list[FsBackend] = []

    def make(root: Path | None = None, chunks: int = 64, **opts) -> FsBackend:
        opts.setdefault("sweep_interval", 3600)  # sweeps happen when a test asks
        opts.setdefault("sweep_after", 0)
        b = create_backend(
            "fs", CODEC, path=str(root or tmp_path / "fs"), size=f"{chunks * STORED}B", **opts
        )
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def test_file_layout_and_options(make, tmp_path: Path) -> None:
    b = make()
    keys, payloads = chunks(2)
    assert b.put(keys, payloads) == [True, True]
    for k, p in zip(keys, payloads, strict=True):
        path = tmp_path / "fs" / CODEC.namespace / k[:1].hex() / f"{k.hex()}.kvc"
        assert b.path_of(k) == str(path)
        assert path.read_bytes() == CODEC.encode(k, p)  # header + payload, nothing else
    assert files(tmp_path / "fs")[1] == []  # no temporary file left
    assert (b.name, b.shared, b.locality, b.medium) == ("fs", True, "LOCAL", "STORAGE")
    assert b.tier_id == f"fs:{tmp_path / 'fs'}"  # instances on one root agree on it
    nfs = make(locality="remote", fsync="true")
    assert nfs.locality == "REMOTE" and nfs.fsync and type(nfs).locality == "LOCAL"
    assert nfs.put(*chunks(1, seed=3)) == [True]
    with pytest.raises(ValueError, match="locality"):
        make(locality="far")
    with pytest.raises(ValueError, match="fsync"):
        make(fsync="sometimes")
    with pytest.raises(ValueError, match="smaller than one chunk"):
        create_backend("fs", CODEC, path=str(tmp_path / "x"), size="1KiB")


def cached_pages(path: str | Path) -> list[bool]:
    """Per page of ``path``, whether the page cache holds it (``mincore`` of a mapping: no
    read, no readahead)."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
        vec = ctypes.create_string_buffer(-(-size // 4096))
        assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        return [bool(b & 1) for b in vec.raw]
    finally:
        with contextlib.suppress(BufferError):
            m.close()


def test_o_direct_writes_bypass_the_page_cache(make, tmp_path: Path) -> None:
    """``o_direct=auto``: chunk files are written with O_DIRECT where the file system takes
    it (ext4 here): the same bytes as a buffered write (header + payload; the last partial page
    buffered), the chunk's pages not left in the page cache, where a buffered tier's stay;
    a spare file (an evicted chunk's) is overwritten the same way and reads back verified."""
    direct = make(root=tmp_path / "direct", chunks=8, o_direct="auto")
    buffered = make(root=tmp_path / "buffered")  # the default: buffered
    assert direct.o_direct == o_direct_works(tmp_path) and buffered.o_direct is False
    assert direct.direct_bytes == STORED // 4096 * 4096 < STORED  # a tail to write buffered
    keys, payloads = chunks(10, seed=7)
    assert direct.put(keys[:9], payloads[:9]) == [True] * 9
    assert buffered.put(keys[:1], payloads[:1]) == [True]
    pages = len(cached_pages(buffered.path_of(keys[0])))
    assert cached_pages(buffered.path_of(keys[0])) == [True] * pages
    if direct.o_direct:  # only the last page, written buffered
        only_tail = [False] * (pages - 1) + [True]
        assert [cached_pages(direct.path_of(k)) for k in keys[:9]] == [only_tail] * 9
    for k, p in zip(keys[:9], payloads[:9], strict=True):
        assert Path(direct.path_of(k)).read_bytes() == CODEC.encode(k, p)
    # Evict (9 chunks > 8: down to 7, the oldest first) and reuse the spare file.
    for i, k in enumerate(keys[:9]):
        os.utime(direct.path_of(k), (time.time() - 100 + i,) * 2)
    assert direct.sweep() == 2 and len(os.listdir(direct._spare_dir)) == 1
    spare = os.stat(Path(direct._spare_dir) / os.listdir(direct._spare_dir)[0]).st_ino
    assert direct.put(keys[9:], payloads[9:]) == [True]
    assert os.stat(direct.path_of(keys[9])).st_ino == spare
    assert Path(direct.path_of(keys[9])).read_bytes() == CODEC.encode(keys[9], payloads[9])
    outs = outs_for(8)
    assert direct.get(keys[2:], outs) == [True] * 8
    assert [bytes(o) for o in outs] == [bytes(p) for p in payloads[2:]]
    assert files(tmp_path / "direct")[1] == [] and direct.stats.errors == 0
    direct.use_o_direct(False)  # buffered on demand (benchmarks compare both in one run)
    more, more_payloads = chunks(1, seed=9)
    assert direct.put(more, more_payloads) == [True]
    assert cached_pages(direct.path_of(more[0])) == [True] * pages
    direct.use_o_direct(True)
    assert direct.o_direct == o_direct_works(tmp_path)
    buffered.use_o_direct(True)
    assert buffered.o_direct == o_direct_works(tmp_path)


def test_o_direct_refused_falls_back_to_buffered_writes(make, mount_fs) -> None:
    """ramfs refuses O_DIRECT: ``auto`` writes buffered, ``true`` is a clear error."""
    d = mount_fs("ramfs")
    b = make(root=d / "auto", o_direct="auto")
    assert b.o_direct is False
    b.use_o_direct(True)  # never where the file system refused it
    assert b.o_direct is False
    keys, payloads = chunks(3, seed=8)
    assert b.put(keys, payloads) == [True] * 3
    outs = outs_for(3)
    assert b.get(keys, outs) == [True] * 3
    assert [bytes(o) for o in outs] == [bytes(p) for p in payloads]
    with pytest.raises(OSError, match="O_DIRECT refused"):
        make(root=d / "forced", o_direct="true")
    assert files(d)[1] == []  # the probe files are gone
    with pytest.raises(ValueError, match="o_direct must be"):
        make(root=d / "bad", o_direct="maybe")


def test_readers_never_see_a_torn_file(make) -> None:
    """Writers keep replacing chunks (remove, then put) while readers read them: a reader finds
    a whole, verified file or none (rename publishes atomically); never a partial one."""
    b = make()
    keys, payloads = chunks(4)
    stop = threading.Event()
    hits = [0]

    def writer() -> None:
        while not stop.is_set():
            b.remove(keys)
            b.put(keys, payloads)

    def reader() -> None:
        outs = outs_for(4)
        while not stop.is_set():
            got = b.get(keys, outs)
            hits[0] += sum(got)
            for g, o, p in zip(got, outs, payloads, strict=True):
                assert not g or bytes(o) == bytes(p)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    stop.wait(3.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert hits[0] > 0
    assert b.stats.corrupt == 0 and b.stats.errors == 0


def _read_from_another_process(root: str, seed: int, n: int) -> list[bool]:
    b = create_backend("fs", CODEC, path=root, size=f"{64 * STORED}B", sweep_interval=3600)
    try:
        keys, payloads = chunks(n, seed)
        outs = outs_for(n)
        got = b.get(keys, outs)
        return [g and bytes(o) == bytes(p) for g, o, p in zip(got, outs, payloads, strict=True)]
    finally:
        b.close()


def test_another_process_loads_what_this_one_stored(make, tmp_path: Path) -> None:
    b = make()
    keys, payloads = chunks(5, seed=11)
    assert b.put(keys, payloads) == [True] * 5
    assert in_subprocess(_read_from_another_process, str(tmp_path / "fs"), 11, 5) == [True] * 5


def test_concurrent_writers_leave_one_file_each(make, tmp_path: Path) -> None:
    a, b = make(), make()  # two instances on one root, threads in each
    keys, payloads = chunks(16)
    barrier = threading.Barrier(8)

    def put(t: FsBackend) -> None:
        barrier.wait()
        assert t.put(keys, payloads) == [True] * 16

    threads = [threading.Thread(target=put, args=(t,)) for t in [a, b] * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    chunk_files, tmp_files = files(tmp_path / "fs")
    assert len(chunk_files) == 16 and tmp_files == []
    assert sorted(f.read_bytes() for f in chunk_files) == sorted(
        CODEC.encode(k, p) for k, p in zip(keys, payloads, strict=True)
    )


def test_sweep_deletes_least_recently_used_down_to_90_percent(make, tmp_path: Path) -> None:
    b = make(chunks=10)
    keys, payloads = chunks(10)
    for k, p in zip(keys, payloads, strict=True):
        assert b.put([k], [p]) == [True]
    assert b.sweep() == 0  # at the limit, not over it
    for i, k in enumerate(keys):  # written a while ago
        past = time.time() - 60 + i
        os.utime(b.path_of(k), (past, past))
    # Hits make 0 and 1 recent: another instance's (b's own would leave files it wrote
    # seconds ago alone: fs.TOUCH_AFTER_S).
    assert make().get(keys[:2], outs_for(2)) == [True, True]
    more, more_payloads = chunks(2, seed=1)
    assert b.put(more, more_payloads) == [True, True]
    assert b.sweep() == 3  # 12 chunks > 10: down to 9 (90%), least recently used first
    assert b.sweep() == 0
    assert b.exists(keys[:2]) == 2 and b.exists(more) == 2
    assert [b.exists([k]) for k in keys[2:]] == [0, 0, 0] + [1] * 5
    assert b.usage() == (9 * STORED, 10 * STORED)
    assert b.stats.evicted == 3


def test_another_instance_touches_what_this_one_wrote(make, tmp_path: Path) -> None:
    """A hit leaves alone a file this instance wrote or touched within ``TOUCH_AFTER_S``; an
    instance that did neither (another engine on the shared root) touches it on its first hit
    and not on its second."""
    a, b = make(), make()
    keys, payloads = chunks(1)
    assert a.put(keys, payloads) == [True]
    path = a.path_of(keys[0])
    past = time.time() - 60
    os.utime(path, (past, past))
    assert a.get(keys, outs_for(1)) == [True]
    assert os.stat(path).st_mtime < time.time() - 30  # a wrote it just now: left alone
    assert b.get(keys, outs_for(1)) == [True]
    touched = os.stat(path).st_mtime_ns
    assert touched > time.time_ns() - 30 * 10**9  # b's first hit
    assert b.get(keys, outs_for(1)) == [True]
    assert os.stat(path).st_mtime_ns == touched  # b's second hit: left alone


def test_sweep_removes_temporary_files_of_dead_writers(make, tmp_path: Path) -> None:
    b = make()
    d = tmp_path / "fs" / CODEC.namespace / "00"
    old, fresh = d / ".tmp-1-2-dead", d / ".tmp-1-2-busy"
    old.write_bytes(b"x" * 100)
    fresh.write_bytes(b"x" * 100)
    past = time.time() - 120
    os.utime(old, (past, past))
    b.sweep()
    assert not old.exists() and fresh.exists()


def test_sweeper_runs_on_its_own(make) -> None:
    """The background sweeper: early once this instance wrote ``sweep_after`` bytes."""
    b = make(chunks=20, sweep_after=f"{STORED}B")
    keys, payloads = chunks(30)
    for k, p in zip(keys, payloads, strict=True):
        assert b.put([k], [p]) == [True]
    deadline = time.monotonic() + 60
    while b.usage()[0] > 20 * STORED and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.usage()[0] <= 20 * STORED and b.stats.evicted >= 10


def test_sweeper_sweeps_early_only_with_something_to_evict(make) -> None:
    """An early sweep lists and stats every file of the namespace: this instance's writes
    (``sweep_after``, 5% of the size by default) bring one forward only once the namespace
    (as the last sweep found it, plus these writes) exceeds the size, or after 4x
    ``sweep_after`` (other instances' writes show only in a listing)."""
    b = make(chunks=40, sweep_after=None)  # early after 2 chunks; a rescan after 8
    assert b.sweep_after == 2 * STORED
    swept: list[int] = []
    sweep = b.sweep

    def counted() -> int:
        swept.append(sweep())
        return swept[-1]

    b.sweep = counted  # type: ignore[method-assign]  # the background sweeper's call
    keys, payloads = chunks(48)
    for k, p in zip(keys[:8], payloads[:8], strict=True):  # 20% of the size: nothing to evict
        assert b.put([k], [p]) == [True]
    time.sleep(0.5)  # a sweep woken by these writes would have run
    assert swept == [] and b.usage() == (8 * STORED, 40 * STORED)
    for k, p in zip(keys[8:], payloads[8:], strict=True):  # over the size: swept early
        assert b.put([k], [p]) == [True]
    deadline = time.monotonic() + 60
    while b.usage()[0] > 40 * STORED and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.usage()[0] <= 40 * STORED and b.stats.evicted >= 8 and sum(swept) >= 8
    assert len(swept) <= 6, swept  # rescans every 8 chunks (5 of 40 written), one over size


def _sweep_in_process(root: str, rounds: int) -> tuple[int, float]:
    """Writes and sweeps (its own background sweeper too); returns (deleted, I/O errors)."""
    b = create_backend("fs", CODEC, path=root, size=f"{10 * STORED}B", sweep_interval=0.01)
    try:
        deleted = 0
        for r in range(rounds):
            keys, payloads = chunks(5, seed=1000 * os.getpid() + r)
            assert b.put(keys, payloads) == [True] * 5
            deleted += b.sweep()
        return deleted, b.stats.errors
    finally:
        b.close()


def test_instances_sweeping_at_once(make, tmp_path: Path) -> None:
    """Two processes writing and sweeping one root at once: no errors (a file the other one
    deleted is skipped), and the root ends within the limit."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    root = str(tmp_path / "fs")
    make()  # creates the namespace
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as ex:
        results = list(ex.map(_sweep_in_process, [root, root], [20, 20], timeout=180))
    assert [errors for _, errors in results] == [0, 0]
    assert sum(deleted for deleted, _ in results) > 0
    b = make(chunks=10)
    b.sweep()
    assert b.usage()[0] <= 10 * STORED
    assert files(tmp_path / "fs")[1] == []


# -- faults ---------------------------------------------------------------------------------
def test_full_file_system_then_space_freed(make, mount_fs) -> None:
    d = mount_fs("tmpfs", size="512k")
    # The limit is not what stops it: the file system is full. One I/O thread: files in order.
    b = make(root=d, chunks=100, io_threads=1)
    keys, payloads = chunks(12)
    res = b.put(keys, payloads)
    fitted = sum(res)
    assert 3 <= fitted < 12 and res == [True] * fitted + [False] * (12 - fitted)
    assert b.stats.errors == 12 - fitted and b.stats.written == fitted
    assert files(d)[1] == []  # every partial temporary file was removed
    outs = outs_for(12)
    assert b.get(keys, outs) == res  # what was stored is intact; the rest is a clean miss
    assert [bytes(o) for o in outs[:fitted]] == [bytes(p) for p in payloads[:fitted]]
    assert b.stats.corrupt == 0
    remount(d, size="4m")  # the fault goes away
    assert b.put(keys, payloads) == [True] * 12
    assert b.get(keys, outs) == [True] * 12


def _write_under_file_size_limit(root: str) -> dict:
    """In a child process: a file-size limit below one chunk file turns every write into EFBIG
    (SIGXFSZ is ignored by Python), then the limit goes away."""
    b = create_backend("fs", CODEC, path=root, size=f"{64 * STORED}B", sweep_interval=3600)
    keys, payloads = chunks(4, seed=5)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (STORED // 2, hard))
    try:
        during = b.put(keys, payloads)
        errors = b.stats.errors
        got = b.get(keys, outs_for(4))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    after = b.put(keys, payloads)
    got_after = b.get(keys, outs_for(4))
    b.close()
    return {"during": during, "errors": errors, "got": got, "after": after,
            "got_after": got_after}  # fmt: skip


def test_file_size_limit_then_lifted(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    r = in_subprocess(_write_under_file_size_limit, str(root))
    assert r["during"] == [False] * 4 and r["errors"] == 4 and r["got"] == [False] * 4
    assert r["after"] == [True] * 4 and r["got_after"] == [True] * 4
    chunk_files, tmp_files = files(root)
    assert len(chunk_files) == 4 and tmp_files == []


def _permission_faults(root: str) -> dict:
    """In a child process running as ``nobody`` (root ignores permission bits): a read-only
    fan-out directory refuses new files, an unreadable one refuses reads too; then access
    comes back."""
    drop_privileges()
    b = create_backend("fs", CODEC, path=root, size=f"{64 * STORED}B", sweep_interval=3600)
    keys, payloads = chunks(3, seed=9)
    same = [b"\x5a" + k[1:] for k in keys]  # one fan-out directory
    assert b.put(same[:1], payloads[:1]) == [True]
    d = os.path.dirname(b.path_of(same[0]))
    r: dict = {}
    os.chmod(d, 0o555)  # read-only: existing chunks readable, new ones refused
    r["ro_put"] = b.put(same[1:2], payloads[1:2])
    r["ro_get"] = b.get(same[:1], outs_for(1))
    r["ro_errors"] = b.stats.errors
    os.chmod(d, 0o000)  # nothing: lookups and reads fail
    r["none_exists"] = b.exists(same[:1])
    r["none_get"] = b.get(same[:1], outs_for(1))
    r["none_errors"] = b.stats.errors
    os.chmod(d, 0o755)  # the fault goes away
    r["back_put"] = b.put(same[1:3], payloads[1:3])
    r["back_get"] = b.get(same, outs_for(3))
    r["corrupt"] = b.stats.corrupt
    b.close()
    return r


def test_permission_denied_then_restored(unprivileged_dir: Path) -> None:
    r = in_subprocess(_permission_faults, str(unprivileged_dir / "fs"))
    assert r["ro_put"] == [False] and r["ro_get"] == [True] and r["ro_errors"] == 1
    assert r["none_exists"] == 0 and r["none_get"] == [False] and r["none_errors"] == 3
    assert r["back_put"] == [True, True] and r["back_get"] == [True] * 3
    assert r["corrupt"] == 0  # a refused read is an error, never a removed chunk


def test_namespace_deleted_under_a_running_instance(make, tmp_path: Path) -> None:
    """An operator wipes the shared directory: writes make it again, reads are misses."""
    import shutil

    b = make()
    keys, payloads = chunks(2)
    assert b.put(keys[:1], payloads[:1]) == [True]
    shutil.rmtree(tmp_path / "fs" / CODEC.namespace)
    assert b.get(keys[:1], outs_for(1)) == [False] and b.stats.errors == 0
    assert b.put(keys, payloads) == [True, True]
    assert b.get(keys, outs_for(2)) == [True, True]
    assert b.sweep() == 0


def test_errno_of_a_missing_root_is_clear(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(OSError, match="fs tier: cannot create") as e:
        create_backend("fs", CODEC, path=str(blocker / "sub"), size="1GiB")
    assert e.value.errno == errno.ENOTDIR


# -- the read path -----------------------------------------------------------------------------
def _drop_cached(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("size", ["exact", "one_byte_short", "one_byte_long", "header_only"])
def test_a_chunk_file_of_the_wrong_size_is_a_miss_warm_or_cold(
    make, size: str, native: bool
) -> None:
    """A read tells a file's size from its own count (no fstat): a file one byte short or one
    byte long, or only a header, is a counted miss and removed, from the page cache and from
    the device; an intact file comes back byte for byte either way, and a read that has to
    wait on the device says so once (``on_wait``). Both read paths: the native group read
    and the one in Python."""
    for cold in (False, True):
        b = make()
        b.native_read = native
        keys, payloads = chunks(1, seed=int(cold))
        assert b.put(keys, payloads) == [True]
        path = b.path_of(keys[0])
        if size == "one_byte_short":
            os.truncate(path, STORED - 1)
        elif size == "one_byte_long":
            with open(path, "ab") as f:
                f.write(b"\0")
        elif size == "header_only":
            os.truncate(path, STORED - CODEC.payload_bytes)
        if cold:
            _drop_cached(path)
        waits: list[int] = []
        outs = outs_for(1)
        got = b.get(keys, outs, on_wait=lambda w=waits: w.append(1))
        if size == "exact":
            assert got == [True] and bytes(outs[0]) == bytes(payloads[0])
        else:
            assert got == [False] and b.stats.corrupt == 1 and not os.path.exists(path)
        assert len(waits) <= 1 and b.stats.errors == 0
