"""The ``disk`` tier on real file systems: geometry, O_DIRECT and its fallback, LRU with
pinned readers, restarts, and faults (file-size limit, full file system, permission denied)."""

from __future__ import annotations

import errno
import mmap
import os
import resource
import threading
import time
from pathlib import Path

import pytest

from kvserve.kv.backends import create_backend
from kvserve.kv.backends.chunk_format import ChunkCodec
from kvserve.kv.backends.disk import DiskBackend, header_key
from tests.kv.conftest import drop_privileges, in_subprocess, remount

CODEC = ChunkCodec(
    model="0123456789abcdef", layout="L2-B16-H2-D32-bfloat16-k2", payload_bytes=64 << 10
)
ODD = ChunkCodec(model="0123456789abcdef", layout="odd", payload_bytes=12345)  # not page sized
SLOT = 68 << 10  # align(64 KiB + 256, 4 KiB)


def chunks(n: int, codec: ChunkCodec = CODEC, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    import random

    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)], [
        rng.randbytes(codec.payload_bytes) for _ in range(n)
    ]


def aligned_outs(n: int, codec: ChunkCodec = CODEC) -> list[memoryview]:
    """Page-aligned destinations (anonymous mmaps), as a page-aligned host tier would give."""
    size = -(-codec.payload_bytes // 4096) * 4096
    return [memoryview(mmap.mmap(-1, size))[: codec.payload_bytes] for _ in range(n)]


def o_direct_works(d: Path) -> bool:
    """Whether this directory's file system takes O_DIRECT I/O (probed independently)."""
    p = d / ".probe"
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, 4096)
        os.preadv(fd, [mmap.mmap(-1, 4096)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        p.unlink()


@pytest.fixture
def make(tmp_path: Path):
    made: list[DiskBackend] = []

    def make(path: Path | None = None, slots: int = 8, codec: ChunkCodec = CODEC, **opts):
        size = slots * (-(-codec.stored_bytes // 4096) * 4096)
        b = create_backend("disk", codec, path=str(path or tmp_path / "d"), size=f"{size}B", **opts)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def test_header_key_reads_the_codec_header() -> None:
    key = bytes(range(32))
    header = CODEC.header(key, bytes(CODEC.payload_bytes))
    assert header_key(header) == key
    assert CODEC.check_header(header_key(header), header) is not None
    assert header_key(header[:100]) is None


def test_geometry_preallocation_and_file_name(make, tmp_path: Path) -> None:
    b = make(slots=5)
    assert b.slot_bytes == SLOT and b.num_slots == 5
    assert b.path.name == f"kvserve-{CODEC.namespace}.slots"
    st = os.stat(b.path)
    assert st.st_size == 5 * SLOT and st.st_blocks * 512 >= 5 * SLOT  # really allocated
    assert b.usage() == (0, 5 * SLOT)
    assert (b.name, b.shared, b.locality, b.medium) == ("disk", False, "LOCAL", "STORAGE")
    with pytest.raises(ValueError, match="smaller than one chunk slot"):
        create_backend("disk", CODEC, path=str(tmp_path / "x"), size="4KiB")
    with pytest.raises(ValueError, match="o_direct must be"):
        create_backend("disk", CODEC, path=str(tmp_path / "x"), size="1MiB", o_direct="maybe")


def test_one_instance_per_directory(make) -> None:
    make()
    with pytest.raises(RuntimeError, match="in use by another process"):
        make()


@pytest.mark.parametrize("codec", [CODEC, ODD], ids=["page_sized", "odd_sized"])
def test_o_direct_on_the_real_file_system(make, tmp_path: Path, codec: ChunkCodec) -> None:
    """Whatever file system holds the test directory (ext4 here): O_DIRECT exactly where it
    works; page-aligned buffers of a page-sized payload go straight to the file, others through
    the bounce buffer; both read back verified."""
    b = make(codec=codec, io_threads=1)
    assert b.o_direct == o_direct_works(tmp_path)
    keys, payloads = chunks(4, codec)
    assert b.put(keys[:2], [memoryview(p) for p in payloads[:2]]) == [True, True]
    src = aligned_outs(2, codec)
    for s, p in zip(src, payloads[2:], strict=True):
        s[:] = p
    assert b.put(keys[2:], src) == [True, True]
    outs = aligned_outs(2, codec) + [memoryview(bytearray(codec.payload_bytes)) for _ in range(2)]
    assert b.get(keys, outs) == [True] * 4
    assert [bytes(o) for o in outs] == payloads
    zero_copy = b.o_direct and codec.payload_bytes % 4096 == 0
    # Slot layout on disk: payload, then the codec's header.
    with open(b.path, "rb") as f:
        f.seek(b.slot_of(keys[0]) * b.slot_bytes)
        raw = f.read(codec.stored_bytes)
    assert raw[: codec.payload_bytes] == payloads[0]
    assert raw[codec.payload_bytes :] == codec.header(keys[0], payloads[0])
    if b.o_direct:
        # The bounce buffer serves only what cannot go direct (unaligned buffers, odd sizes).
        del b._tls.bounce
        assert b.get(keys[:2], outs[:2]) == [True, True]
        assert hasattr(b._tls, "bounce") == (not zero_copy)


def test_fallback_to_buffered_io_where_o_direct_is_refused(make, mount_fs) -> None:
    """ramfs refuses O_DIRECT (tmpfs takes it since Linux 6.6): auto falls back to buffered I/O,
    ``o_direct=true`` is a clear error."""
    d = mount_fs("ramfs")
    assert not o_direct_works(d)
    b = make(path=d / "auto")
    assert b.o_direct is False
    keys, payloads = chunks(3)
    assert b.put(keys, [memoryview(p) for p in payloads]) == [True] * 3
    outs = aligned_outs(3)
    assert b.get(keys, outs) == [True] * 3 and [bytes(o) for o in outs] == payloads
    b.close()
    assert make(path=d / "auto").exists(keys) == 3  # rebuilt through buffered reads too
    with pytest.raises(OSError, match="O_DIRECT refused"):
        make(path=d / "forced", o_direct="true")
    assert make(path=d / "off", o_direct="false").o_direct is False


def test_lru_eviction_reported(make) -> None:
    b = make(slots=4)
    keys, payloads = chunks(6)
    views = [memoryview(p) for p in payloads]
    assert b.put(keys[:4], views[:4]) == [True] * 4
    assert b.get(keys[:1], aligned_outs(1)) == [True]  # key 0 is now the most recent
    assert b.put(keys[4:5], views[4:5]) == [True]
    assert b.take_evicted() == [keys[1]] and b.take_evicted() == []
    assert b.put(keys[0:1], views[0:1]) == [True]  # a store of a held chunk refreshes it too
    assert b.put(keys[5:6], views[5:6]) == [True]
    assert b.take_evicted() == [keys[2]]
    assert b.stats.evicted == 2
    assert b.exists([keys[0], keys[3], keys[4], keys[5]]) == 4
    assert b.put(keys[1:3], views[1:3]) == [True, True]
    assert b.take_evicted() == [keys[3], keys[4]]  # in LRU order
    assert b.usage()[0] == 4 * SLOT


def test_a_slot_being_read_is_never_overwritten(make) -> None:
    """One slot, one reader of chunk A, writers of other chunks: every write needs A's slot.
    A pinned slot is not handed out, so a read is a verified hit or a clean miss, never a slot
    overwritten under it (which the hash would then reject as corrupt)."""
    b = make(slots=1)
    keys, payloads = chunks(9)
    views = [memoryview(p) for p in payloads]
    stop = threading.Event()
    seen = {"hit": 0, "wrong": 0}

    def reader() -> None:
        out = aligned_outs(1)
        while not stop.is_set():
            b.put(keys[:1], views[:1])
            if b.get(keys[:1], out) == [True]:
                seen["hit"] += 1
                seen["wrong"] += bytes(out[0]) != payloads[0]

    def writer(i: int) -> None:
        while not stop.is_set():
            b.put(keys[i : i + 1], views[i : i + 1])
            time.sleep(0)  # let a reader's put-then-get through now and then

    threads = [threading.Thread(target=reader) for _ in range(2)]
    threads += [threading.Thread(target=writer, args=(i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    # At least 3 s of contention and enough hits to have checked some reads (a loaded machine
    # can keep the readers out for seconds: their put is overwritten before their get).
    deadline = time.monotonic() + 60
    stop.wait(3.0)
    while seen["hit"] < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(30)
    assert seen["hit"] > 0 and seen["wrong"] == 0
    assert b.stats.corrupt == 0 and b.stats.errors == 0
    assert b.stats.dropped > 0  # writes that found the only slot pinned were dropped


def test_restart_keeps_chunks_resizes_and_forgets_removed(make, tmp_path: Path) -> None:
    b = make(slots=6)
    keys, payloads = chunks(6)
    views = [memoryview(p) for p in payloads]
    assert b.put(keys[:5], views[:5]) == [True] * 5
    b.remove(keys[4:5])  # its header is zeroed: a restart does not bring it back
    # A write cut short by a crash: the header is in place, the payload only half.
    slot = b.slot_of(keys[3])
    with open(b.path, "r+b") as f:
        f.seek(slot * SLOT + CODEC.payload_bytes // 2)
        f.write(os.urandom(1024))
    b.close()

    b = make(slots=6)
    assert b.exists(keys) == 4
    outs = aligned_outs(4)
    assert b.get(keys[:4], outs) == [True, True, True, False]
    assert [bytes(o) for o in outs[:3]] == payloads[:3]
    assert b.stats.corrupt == 1 and b.exists(keys[3:4]) == 0
    b.close()

    grown = make(slots=9)  # a larger size keeps what the old file held
    assert grown.exists(keys) == 3 and grown.num_slots == 9
    assert os.stat(grown.path).st_size == 9 * SLOT
    grown.close()
    shrunk = make(slots=1)  # a smaller one drops the tail slots
    assert shrunk.exists(keys[:1]) == 1 and shrunk.exists(keys[1:]) == 0
    assert os.stat(shrunk.path).st_size == SLOT


def test_another_model_replaces_the_old_file(make, tmp_path: Path) -> None:
    a = make()
    keys, payloads = chunks(2)
    assert a.put(keys, [memoryview(p) for p in payloads]) == [True, True]
    old = a.path
    a.close()
    other = ChunkCodec("fedcba9876543210", CODEC.layout, CODEC.payload_bytes)
    b = make(codec=other)
    assert b.path != old and not old.exists()  # the directory is bounded by size
    assert b.exists(keys) == 0


# -- faults ---------------------------------------------------------------------------------
def _writes_past_a_file_size_limit(path: str) -> dict:
    """In a child process: the slot file exists; a file-size limit of two slots turns writes to
    every later slot into EFBIG (a real failing write), then the limit goes away."""
    b = create_backend("disk", CODEC, path=path, size=f"{6 * SLOT}B", io_threads=1)
    keys, payloads = chunks(6, seed=7)
    views = [memoryview(p) for p in payloads]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * SLOT, hard))
    try:
        during = b.put(keys, views)
        errors = b.stats.errors
        held = b.exists(keys)
        got = b.get(keys, aligned_outs(6))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    after = b.put(keys, views)
    outs = aligned_outs(6)
    ok_after = b.get(keys, outs) == [True] * 6 and [bytes(o) for o in outs] == payloads
    b.close()
    return {"during": during, "errors": errors, "held": held, "got": got, "after": after,
            "ok_after": ok_after}  # fmt: skip


def test_failing_writes_are_counted_and_recover(tmp_path: Path) -> None:
    d = tmp_path / "d"
    create_backend("disk", CODEC, path=str(d), size=f"{6 * SLOT}B").close()
    r = in_subprocess(_writes_past_a_file_size_limit, str(d))
    # Slots are handed out from the start of the file: two fit under the limit.
    assert r["during"] == [True, True, False, False, False, False]
    assert r["errors"] == 4
    assert r["held"] == 2 and r["got"] == [True, True] + [False] * 4  # no half-written slot
    assert r["after"] == [True] * 6 and r["ok_after"]


def _open_under_file_size_limit(path: str) -> str:
    resource.setrlimit(resource.RLIMIT_FSIZE, (SLOT, resource.RLIM_INFINITY))
    try:
        create_backend("disk", CODEC, path=path, size=f"{4 * SLOT}B")
    except OSError as e:
        return f"{errno.errorcode[e.errno]}: {e}"
    return "opened"


def test_preallocation_past_a_file_size_limit_is_a_clear_error(tmp_path: Path) -> None:
    d = tmp_path / "d"
    msg = in_subprocess(_open_under_file_size_limit, str(d))
    assert msg.startswith("EFBIG") and "cannot preallocate" in msg
    assert list(d.iterdir()) == []  # no partial file left
    b = create_backend("disk", CODEC, path=str(d), size=f"{4 * SLOT}B")  # no limit: it opens
    b.close()


def test_full_file_system_at_start_then_space_freed(mount_fs, make) -> None:
    d = mount_fs("tmpfs", size="256k")
    with pytest.raises(OSError, match="cannot preallocate") as e:
        make(path=d, slots=8)
    assert e.value.errno == errno.ENOSPC
    assert list(d.iterdir()) == []
    remount(d, size="1m")  # the fault goes away
    b = make(path=d, slots=8)
    keys, payloads = chunks(8)
    assert b.put(keys, [memoryview(p) for p in payloads]) == [True] * 8
    assert b.get(keys, aligned_outs(8)) == [True] * 8


def _open_in(path: str, mode: int) -> str:
    drop_privileges()
    os.chmod(path, mode)
    try:
        b = create_backend("disk", CODEC, path=f"{path}/tier", size=f"{2 * SLOT}B")
    except PermissionError as e:
        return f"denied: {e}"
    b.close()
    return "opened"


def test_permission_denied_is_a_clear_error_then_recovers(unprivileged_dir: Path) -> None:
    """Run as ``nobody`` when root (root ignores permission bits)."""
    d = str(unprivileged_dir)
    msg = in_subprocess(_open_in, d, 0o500)
    assert msg.startswith("denied") and "disk tier: cannot create" in msg and d in msg
    assert in_subprocess(_open_in, d, 0o700) == "opened"
