"""The fs tier reuses the files of evicted chunks (spare files) instead of creating a file per
write and deleting one per eviction, on a real file system: which files are reused, the bound
on spares, and a read that races with the reuse of its file (a miss, never a wrong chunk nor a
good chunk removed)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.kv.backends import create_backend
from kvserve.kv.backends import fs as fs_module
from kvserve.kv.backends.chunk_format import ChunkCodec
from kvserve.kv.backends.fs import FsBackend
from tests.kv.conftest import drop_cached

CODEC = ChunkCodec("0123456789abcdef", "L2-B16-H2-D32-bfloat16-k2", payload_bytes=64 << 10)
STORED = CODEC.stored_bytes


def chunks(n: int, seed: int) -> tuple[list[bytes], list[memoryview]]:
    rng = random.Random(seed)
    keys = [rng.randbytes(32) for _ in range(n)]
    return keys, [memoryview(rng.randbytes(CODEC.payload_bytes)) for _ in range(n)]


def outs_for(n: int) -> list[memoryview]:
    return [memoryview(bytearray(CODEC.payload_bytes)) for _ in range(n)]


@pytest.fixture
def fs(device_dir: Path) -> Iterator[FsBackend]:
    """A tier of 40 chunks, swept when the test asks: spares for 15% of it (6 files); its
    pages can be dropped (:func:`drop_cached`)."""
    tier = create_backend(
        "fs", CODEC, path=str(device_dir), size=f"{40 * STORED}B", sweep_interval=3600,
        sweep_after=0,
    )  # fmt: skip
    yield tier
    tier.close()


def spare_files(tier: FsBackend) -> list[Path]:
    return sorted(Path(tier._spare_dir).iterdir())


def test_evicted_files_are_reused_by_later_writes(fs: FsBackend) -> None:
    """A sweep keeps up to ``spare_limit`` evicted files (the rest deleted); the next writes
    take them (the same inodes, no file created) and read back verified; the evicted chunks
    are misses."""
    assert fs.spare_limit == 6
    keys, payloads = chunks(50, seed=1)
    for i, (k, p) in enumerate(zip(keys, payloads, strict=True)):
        assert fs.put([k], [p]) == [True]
        past = time.time() - 100 + i  # written in this order, a while ago
        os.utime(fs.path_of(k), (past, past))
    inodes = {os.stat(fs.path_of(k)).st_ino: k for k in keys}
    assert fs.sweep() == 14  # 50 chunks > 40: down to 36, least recently used first
    assert [fs.exists([k]) for k in keys] == [0] * 14 + [1] * 36
    spares = spare_files(fs)
    assert len(spares) == 6 and all(p.stat().st_size == STORED for p in spares)
    spare_inodes = {p.stat().st_ino for p in spares}
    assert {inodes[i] for i in spare_inodes} <= set(keys[:14])  # evicted chunks' files
    new, new_payloads = chunks(8, seed=2)
    assert fs.put(new, new_payloads) == [True] * 8
    reused = {os.stat(fs.path_of(k)).st_ino for k in new} & spare_inodes
    assert reused == spare_inodes and spare_files(fs) == []  # 6 reused, 2 files created
    outs = outs_for(8)
    assert fs.get(new, outs) == [True] * 8
    assert [bytes(o) for o in outs] == [bytes(p) for p in new_payloads]
    assert fs.get(keys[:14], outs_for(14)) == [False] * 14
    assert fs.stats.corrupt == 0 and fs.usage()[0] == 44 * STORED


def test_spares_over_the_limit_or_of_another_size_are_deleted(fs: FsBackend) -> None:
    spare = Path(fs._spare_dir)
    for i in range(9):
        (spare / f"x{i}").write_bytes(b"\0" * STORED)
    (spare / "short").write_bytes(b"\0" * 100)
    fs.sweep()
    left = spare_files(fs)
    assert len(left) == 6 and all(p.stat().st_size == STORED for p in left)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_read_racing_with_the_reuse_of_its_file_is_a_miss(
    fs: FsBackend, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """A reader opened chunk A's file; before it reads, A is evicted and its file reused for
    chunk B. The read fails verification (B's header), and is a miss: not counted corrupt,
    and B's file (A's old inode under B's name) is not removed. The race is made: A's file
    is not cached, and the read's ``on_wait`` (native: called once the file is open) or its
    read of the rest (Python) evicts A and writes B first."""
    fs.native_read = native
    (a, b), (pa, pb) = chunks(2, seed=3)
    assert fs.put([a], [pa]) == [True]
    inode = os.stat(fs.path_of(a)).st_ino
    drop_cached(fs, [a])
    read = fs_module.preadv_until_full
    raced: list[int] = []

    def reuse() -> None:
        if not raced:
            raced.append(1)
            assert fs._retire(fs.path_of(a))  # evicted (a spare) ...
            assert fs.put([b], [pb]) == [True]  # ... and taken by B's write

    def reuse_then_read(fd: int, views: list, offset: int) -> int:
        reuse()
        return read(fd, views, offset)

    monkeypatch.setattr(fs_module, "preadv_until_full", reuse_then_read)
    assert fs.get([a], outs_for(1), on_wait=reuse if native else None) == [False]
    monkeypatch.undo()
    assert raced and inode == os.stat(fs.path_of(b)).st_ino  # B was written into A's old file
    assert fs.stats.corrupt == 0 and fs.stats.misses == 1
    out = outs_for(1)
    assert fs.get([b], out) == [True] and bytes(out[0]) == bytes(pb)
