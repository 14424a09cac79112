"""The fs tier's native group read (``_fs_read``): what it reports per file (bytes read or
-errno, inode, the payload's xxh3-128), its ``on_wait`` call, and the tier's verification of a
group built on it, the same as the Python read's; and that the install built it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.backends import fs
from kvserve.kv.backends.chunk_format import HEADER_BYTES
from tests.kv.conftest import drop_cached
from tests.kv.test_backend_fs import CODEC, STORED, chunks, outs_for

try:
    from kvserve.kv.backends import _fs_read
except ImportError:  # the install test below fails then; the others are skipped
    _fs_read = None
needs_native = pytest.mark.skipif(_fs_read is None, reason="the C extension was not built")


def test_the_install_built_the_native_read_and_found_the_hash() -> None:
    # setup.py marks the extension optional; scripts/setup.sh installs with a compiler, so a
    # silently failed build (or a hash not found) shows up here, not as a slower fs tier.
    assert fs.NATIVE_READ and fs.NATIVE_HASH


@needs_native
@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=5000), st.integers(0, 300_000))
def test_digest_is_xxhash_xxh3_128(data: bytes, pad: int) -> None:
    """The hash the native read uses is the one chunks are written with, at every length
    (xxh3 switches algorithms at 16, 128 and 240 bytes, and by stripes above)."""
    buf = data + bytes(range(256)) * (pad // 256)
    assert _fs_read.digest(buf) == xxhash.xxh3_128_digest(buf)


def _group(tmp_path: Path) -> tuple[list[str], list[bytes]]:
    """Files of every kind a group read meets: an intact chunk, a missing one, one byte short,
    one byte long, a directory; and their contents."""
    rng_keys, payloads = chunks(1, seed=3)
    del rng_keys
    whole = bytes(HEADER_BYTES) + bytes(payloads[0])
    contents = {"intact": whole, "short": whole[:-1], "long": whole + b"x"}
    paths = []
    for name in ("intact", "missing", "short", "long", "dir"):
        p = tmp_path / name
        if name == "dir":
            p.mkdir()
        elif name != "missing":
            p.write_bytes(contents[name])
        paths.append(str(p))
    return paths, [contents.get(n, b"") for n in ("intact", "missing", "short", "long", "dir")]


@needs_native
def test_read_files_reports_each_file(tmp_path: Path) -> None:
    paths, contents = _group(tmp_path)
    n = len(paths)
    headers = bytearray(n * HEADER_BYTES)
    outs = outs_for(n)
    past = bytearray(1)
    got = _fs_read.read_files(paths, headers, outs, past, None)
    counts = [c for c, _, _ in got]
    assert counts == [STORED, -errno.ENOENT, STORED - 1, STORED + 1, -errno.EISDIR]
    inodes = [ino for _, ino, _ in got]
    assert inodes[0] == os.stat(paths[0]).st_ino and inodes[3] == os.stat(paths[3]).st_ino
    assert inodes[1] == 0
    # The digest only for a file of the chunk's size, of the payload read.
    assert got[0][2] == xxhash.xxh3_128_digest(contents[0][HEADER_BYTES:])
    assert [d is None for _, _, d in got] == [False, True, True, True, True]
    assert bytes(outs[0]) == contents[0][HEADER_BYTES:]
    assert bytes(outs[2])[:-1] == contents[2][HEADER_BYTES:] and bytes(past) == b"x"


@needs_native
def test_read_files_checks_its_arguments(tmp_path: Path) -> None:
    paths, _ = _group(tmp_path)
    headers, past = bytearray(HEADER_BYTES), bytearray(1)
    with pytest.raises(ValueError, match="differ in length"):
        _fs_read.read_files(paths[:1], headers, outs_for(2), past, None)
    with pytest.raises(BufferError):  # read-only destination
        _fs_read.read_files(paths[:1], headers, [bytes(CODEC.payload_bytes)], past, None)
    with pytest.raises(ValueError, match="one byte"):
        _fs_read.read_files(paths[:1], headers, outs_for(1), bytearray(0), None)
    with pytest.raises(TypeError, match="callable"):
        _fs_read.read_files(paths[:1], headers, outs_for(1), past, 3)
    assert _fs_read.read_files([], bytearray(0), [], past, None) == []


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@needs_native
def test_on_wait_once_before_the_device_and_its_exception_propagates(device_dir: Path) -> None:
    """A group from the device: ``on_wait`` runs once, at the first file the page cache does
    not hold; an exception from it stops the read, propagates, and leaves no file open."""
    device_fs = fs.FsBackend(CODEC, path=str(device_dir), size="64MiB", sweep=False)
    keys, payloads = chunks(4, seed=5)
    assert device_fs.put(keys, payloads) == [True] * 4
    paths = [device_fs.path_of(k) for k in keys]
    # The first file cached, the others not.
    drop_cached(device_fs, keys[1:])
    waits: list[int] = []
    headers, outs = bytearray(4 * HEADER_BYTES), outs_for(4)
    got = _fs_read.read_files(paths, headers, outs, bytearray(1), lambda: waits.append(1))
    assert waits == [1] and [c for c, _, _ in got] == [STORED] * 4
    assert all(bytes(o) == bytes(p) for o, p in zip(outs, payloads, strict=True))

    drop_cached(device_fs, keys)
    before = _open_fds()

    def refuse() -> None:
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"):
        _fs_read.read_files(paths, headers, outs, bytearray(1), refuse)
    assert _open_fds() == before
    device_fs.close()


@needs_native
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_group_with_good_and_bad_chunks(tmp_path: Path, native: bool) -> None:
    """One ``get`` over intact, missing, bit-flipped and other-key chunks: each its own verdict,
    the bad ones counted and removed, the good ones byte for byte (both read paths)."""
    b = fs.FsBackend(CODEC, path=str(tmp_path / "fs"), size="64MiB", sweep=False)
    try:
        b.native_read = native
        keys, payloads = chunks(6, seed=9)
        assert b.put(keys, payloads) == [True] * 6
        os.unlink(b.path_of(keys[1]))
        flipped = bytearray(Path(b.path_of(keys[2])).read_bytes())
        flipped[-1] ^= 1
        Path(b.path_of(keys[2])).write_bytes(flipped)
        os.replace(b.path_of(keys[5]), b.path_of(keys[4]))  # keys[4]'s path: keys[5]'s chunk
        outs = outs_for(6)
        got = b.get(keys, outs)
        assert got == [True, False, False, True, False, False]
        assert bytes(outs[0]) == bytes(payloads[0]) and bytes(outs[3]) == bytes(payloads[3])
        assert b.stats.corrupt == 2 and b.stats.hits == 2 and b.stats.errors == 0
        assert not os.path.exists(b.path_of(keys[2])) and not os.path.exists(b.path_of(keys[4]))
    finally:
        b.close()
