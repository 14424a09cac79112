"""The ``fs`` tier: a directory shared by several instances (a local or network file system),
one file per chunk.

Owns the file naming, the atomic write (a unique temporary name in the chunk's directory, then
``rename``: a reader never sees a torn file), the verified read, and the retention sweeper that
bounds the namespace's size. Options (``fs:path=/mnt/kv,size=500``): ``path`` (the shared
root), ``size`` (retention limit, GiB or ``512MiB``: every instance applies it),
``sweep_interval`` (seconds between sweeps), ``sweep_after`` (bytes this instance writes that
bring the next sweep forward; default 5% of ``size``, 0: never), ``fsync`` (flush each file
before its rename; default off: a crash loses at most recent chunks, and the hash rejects a
torn one), ``locality`` (``LOCAL``, or ``REMOTE`` for NFS and other network file systems),
``sweep`` (default true; false: this instance applies no retention, others do; with a storage
writer process, retention moves there with the writes: the engine's instance stops sweeping),
``writeback`` (default true: the writing thread starts each file's writeback itself,
``sync_file_range``, so that the kernel's flusher threads, which run at normal priority beside
the engine, have nothing left to do for it), ``o_direct`` (``false``, the default: buffered
writes, the pages staying cached for readers on this node; ``auto``: chunk files written with
O_DIRECT where the file system takes it, else buffered; ``true``: O_DIRECT required).
O_DIRECT skips the page cache: a buffered write copies each chunk into it and the writeback
reads it again (two passes over memory per stored byte), and the cache grows with every
chunk written although the chunk is cached where it matters (the writer's host tier). What it
costs: an instance on the same node reads another's fresh chunk from the device, not from
memory (``fs-cold`` vs ``fs`` in ``benchmarks/bench_tiers.py``); instances on other nodes of
a network file system never had the writer's page cache. Measured on a 2-vCPU VM (ext4, a
100 MB/s stream beside a CPU decode): no difference in the decode's speed and none in the
writer's CPU (ext4's inode allocation dominates it), hence off by default. The file format
is unchanged: the header and the payload's first bytes, a whole number of pages, are copied
into a page-aligned buffer of the writing thread and written direct; the payload's last
``stored_bytes % 4096`` bytes are written buffered (the file's last page, appended: no
read-modify-write of a block).
Reads and writes run in the caller's thread, one file after the other: the storage worker owns
the concurrency (its I/O threads each read one contiguous shard of a staging read); the
``io_threads`` option is accepted for old configurations and ignored. A read first takes what
the page cache holds without waiting (``RWF_NOWAIT``) and tells the caller (``on_wait``, once
per call) before it waits on the device for the rest: chunks another process just wrote are
a memory copy, best made by one or two threads, chunks on the device want reads in flight.
A call's files are opened, read, hashed (xxh3-128) and closed in C without the GIL
(``_fs_read``; one GIL release per call instead of three per file, each a hand-off when two
threads read), and verified here; without the extension, one by one in Python.

Layout: ``<path>/<codec.namespace>/<key[0:1].hex()>/<key.hex()>.kvc``, each file being
``codec.header(key, payload) + payload``. The namespace separates models, layouts and format
versions; the header and full-content hash are checked on every read, and a file that fails
(truncated, bit-flipped, another format) is removed and counted.

Retention is LRU-ish across instances: a write and a hit set the file's mtime (to the
nanosecond; a hit on a file this instance wrote or touched less than ``TOUCH_AFTER_S`` ago
leaves it: recency to within seconds is enough for retention, and a hit then costs no
metadata write, an RPC on NFS, nor an fstat), and a sweep (every ``sweep_interval``, and
early once this instance wrote ``sweep_after`` bytes since the last one and what that sweep
found plus what it wrote since exceeds ``size``, or wrote 4x ``sweep_after``: what other
instances wrote shows only in a listing) deletes the least recently used files until the
namespace holds 90% of ``size``, plus temporary files left for more than a minute by a
writer that died. A sweep lists and stats
every file of the namespace: sweeping only when there is something to evict halves the
sweeps of a full tier under a steady stream (from 90% of ``size`` a sweep every 10% of it
written, not every 5%) and leaves a filling one to its interval (and every 20% of ``size``).
Instances may sweep at once: a file another one already deleted is skipped.

An evicted file is not deleted but moved to ``<namespace>/spare/`` (up to 15% of ``size``:
what a sweep evicts and what is written until the next one), and a write takes a spare file
(claimed by renaming it to the writer's temporary name: of several writers one wins) and
overwrites it whole instead of creating one: a steady stream then allocates and frees no
inodes or blocks (ext4 without a journal scans every inode freed in the last minutes on each
allocation; a create and an unlink are RPCs on NFS). A reader whose file was evicted and
reused under it fails verification and has a miss (not counted corrupt: the path no longer
names the file it read, so nothing is removed).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvserve.kv.backends import register_backend
from kvserve.kv.backends.chunk_format import HEADER_BYTES, ChunkCodec, payload_digest
from kvserve.kv.backends.disk import (
    PAGE,
    advance,
    parse_o_direct,
    preadv_until_full,
    pwritev_all,
)
from kvserve.kv.backends.storage import (
    StorageBackend,
    lower_thread_priority,
    parse_flag,
    parse_size,
)

try:  # the group read without the GIL (setup.py builds it; optional)
    from kvserve.kv.backends import _fs_read
except ImportError:  # pragma: no cover - no C compiler at install
    _fs_read = None

logger = logging.getLogger(__name__)

NATIVE_READ = _fs_read is not None


def _native_hash() -> bool:
    """Whether the native read hashes what it reads: it takes xxh3-128 from the xxhash
    package's extension (the one :func:`payload_digest` calls), checked here against it."""
    if _fs_read is None:
        return False
    try:
        import xxhash._xxhash as ext  # the binding's compiled module, which exports xxHash
    except ImportError:  # pragma: no cover - another layout of the package
        return False
    if not _fs_read.use_hash(ext.__file__):
        return False
    probe = os.urandom(4099)
    if _fs_read.digest(probe) != payload_digest(probe):
        _fs_read.no_hash()
        return False
    return True


NATIVE_HASH = _native_hash()

SUFFIX = ".kvc"
TMP_PREFIX = ".tmp-"
TMP_MAX_AGE_S = 60.0  # a temporary file older than this belongs to a writer that died
SPARE_DIR = "spare"  # evicted chunk files kept for the next writes to reuse
SPARE_RELIST_S = 1.0  # a writer that found no spare lists the directory again after this
SWEEP_LOW_WATER = 0.9  # a sweep deletes down to this fraction of size
SWEEP_EARLY = 0.05  # this instance's writes (fraction of size) that may trigger a sweep early
SWEEP_RESCAN = 4  # x sweep_after written: an early sweep anyway (others' writes show in listings)
TOUCH_AFTER_S = 10.0  # a hit sets the mtime of a file this instance left alone for longer
_TOUCHED_MAX = 1 << 16  # keys whose last write or touch an instance remembers
# A writer process that sweeps reports the namespace's bytes under this name in its counters.
USAGE_STAT = "fs_usage_bytes"

_MISS, _HIT, _CORRUPT = 0, 1, 2


# preadv2 flag: read only what the page cache holds, never wait for the device (Linux >= 4.14).
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages back, in the calling thread, without waiting for it
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; elsewhere nothing: the kernel's own)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _names_inode(path: str, ino: int) -> bool:
    """``path`` still names the file whose inode is ``ino`` (same file system: spares too)."""
    try:
        return os.stat(path).st_ino == ino
    except OSError:
        return False


def _touch(file: int | str) -> None:
    """Set a chunk file's times to now, to the nanosecond: the file system's own clock ticks
    every few milliseconds, too coarse to order chunks written back to back. Another user's
    file refuses explicit times: then the coarse now, or nothing (retention then goes by its
    write time)."""
    now = time.time_ns()
    try:
        os.utime(file, ns=(now, now))
    except PermissionError:
        with contextlib.suppress(OSError):
            os.utime(file)
    except OSError:
        pass


@register_backend("fs")
class FsBackend(StorageBackend):
    """One file per chunk under a shared root, written by rename, bounded by a sweeper."""

    name = "fs"
    locality = "LOCAL"
    shared = True
    page_cache_reads = True

    def __init__(
        self,
        codec: ChunkCodec,
        *,
        tier_id: str | None = None,
        path: str | os.PathLike,
        size: Any,
        sweep_interval: Any = 30.0,
        sweep_after: Any = None,
        fsync: Any = False,
        locality: str = "LOCAL",
        io_threads: Any = 4,
        sweep: Any = True,
        writeback: Any = True,
        o_direct: Any = False,
    ) -> None:
        root = Path(path).absolute()
        # Instances sharing the root agree on this id (how the router learns who shares).
        super().__init__(codec, tier_id=tier_id or f"fs:{root}")
        loc = str(locality).strip().upper()
        if loc not in ("LOCAL", "REMOTE"):
            raise ValueError(f"fs tier: locality must be LOCAL or REMOTE, got {locality!r}")
        self.locality = loc  # type: ignore[misc]  # per instance: the same class serves NFS
        self.size_bytes = parse_size(size)
        if self.size_bytes < codec.stored_bytes:
            raise ValueError(
                f"fs tier size {self.size_bytes} bytes is smaller than one chunk "
                f"({codec.stored_bytes} bytes); raise size"
            )
        self.sweep_interval = float(sweep_interval)
        if self.sweep_interval <= 0:
            raise ValueError(f"fs tier: sweep_interval must be > 0, got {sweep_interval!r}")
        # Bytes this instance writes that trigger a sweep before the interval (0: never).
        self.sweep_after = (
            int(SWEEP_EARLY * self.size_bytes) if sweep_after is None else parse_size(sweep_after)
        )
        self.fsync = parse_flag(fsync, "fs tier: fsync")
        self.writeback = parse_flag(writeback, "fs tier: writeback")
        self.stored_bytes = codec.stored_bytes
        self.root = root
        self.dir = root / codec.namespace
        self._dir_s = str(self.dir)
        self._spare_dir = f"{self._dir_s}/{SPARE_DIR}"
        # Evicted files kept for reuse: what a sweep evicts (down to 90% of size) and what is
        # written until the next one. The namespace's peak stays as without spares (size plus
        # what is written between sweeps): the writes that would grow it take spares instead.
        spare_bytes = (1 - SWEEP_LOW_WATER + SWEEP_EARLY) * self.size_bytes
        self.spare_limit = round(spare_bytes) // self.stored_bytes
        self._spares: deque[str] = deque()  # names in the spare directory to try first
        self._spares_listed = -SPARE_RELIST_S  # time.monotonic() of the last listing
        try:
            self._make_dirs()
        except OSError as e:
            raise OSError(e.errno, f"fs tier: cannot create {self.dir}: {e.strerror}") from e
        del io_threads  # reads run in the caller's thread (the storage worker shards them)
        # Bytes of a chunk file written with O_DIRECT (the rest, under a page, buffered).
        self.direct_bytes = self.stored_bytes // PAGE * PAGE
        self._tls = threading.local()  # each writing thread's page-aligned buffer
        self._past_end = bytearray(1)  # a read's byte past the chunk: filled by a long file
        self._touched: dict[bytes, float] = {}  # key -> monotonic time of a write or touch
        want = parse_o_direct(o_direct)
        self._o_direct_ok = self._probe_o_direct(want)  # usable here (use_o_direct)
        self.o_direct = self._o_direct_ok and want is not False
        self._nowait = _RWF_NOWAIT != 0  # reads can tell a cached chunk from one that waits
        self.native_read = NATIVE_READ  # a group of files read in C (else one by one here)
        self._lock = threading.Lock()
        self._used = 0  # bytes in the namespace at the last sweep
        self._written_since_sweep = 0  # bytes this instance wrote since then
        self._logged_errnos: set[int] = set()
        self._sweep_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._sweeper: threading.Thread | None = None
        if parse_flag(sweep, "fs tier: sweep"):
            self.sweep()
            self._sweeper = threading.Thread(
                target=self._sweep_loop, name="kv-fs-sweep", daemon=True
            )
            self._sweeper.start()
        logger.info(
            "fs tier %s (%s, %s writes): retention %d bytes, %d bytes held, sweep every %.0f s",
            self.dir,
            self.locality,
            "O_DIRECT" if self.o_direct else "buffered",
            self.size_bytes,
            self._used,
            self.sweep_interval,
        )

    def _make_dirs(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for i in range(256):
            os.makedirs(f"{self._dir_s}/{i:02x}", exist_ok=True)
        os.makedirs(self._spare_dir, exist_ok=True)

    def _probe_o_direct(self, want: bool | None) -> bool:
        """Whether chunk files can be written with O_DIRECT here: proved by one aligned
        write of a probe file in the namespace (``auto`` falls back to buffered writes where
        the file system refuses it; ``true`` then raises)."""
        if not hasattr(os, "O_DIRECT") or self.direct_bytes == 0:
            if want:
                raise ValueError("fs tier: o_direct=true needs O_DIRECT and chunks of a page")
            return False
        probe = f"{self._dir_s}/{TMP_PREFIX}probe-{os.getpid()}-{os.urandom(4).hex()}"
        page = mmap.mmap(-1, PAGE)
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT)
            try:
                os.pwrite(fd, page, 0)
            finally:
                os.close(fd)
        except OSError as e:
            if want:
                msg = f"fs tier: O_DIRECT refused on {self.dir}: {e.strerror}"
                raise OSError(e.errno, msg) from e
            if want is None:
                logger.info("fs tier %s: O_DIRECT refused (%s): buffered", self.dir, e.strerror)
            return False
        finally:
            page.close()
            with contextlib.suppress(OSError):
                os.unlink(probe)
        return True

    def use_o_direct(self, on: bool) -> None:
        """Write buffered from now on (False), or with O_DIRECT where the tier found it
        usable (True), whatever the ``o_direct`` option said: benchmarks compare both in one
        run."""
        self.o_direct = on and self._o_direct_ok

    def _header_buffer(self, n: int = 1) -> memoryview:
        """This thread's buffer for ``n`` chunk files' headers (reads)."""
        buf = getattr(self._tls, "header", None)
        if buf is None or len(buf) < n * HEADER_BYTES:
            buf = self._tls.header = memoryview(bytearray(max(n, 16) * HEADER_BYTES))
        return buf[: n * HEADER_BYTES]

    def _bounce(self) -> memoryview:
        """This thread's page-aligned buffer of :attr:`direct_bytes`."""
        buf = getattr(self._tls, "bounce", None)
        if buf is None:
            buf = self._tls.bounce = memoryview(mmap.mmap(-1, self.direct_bytes))
        return buf

    def path_of(self, key: bytes) -> str:
        """Where chunk ``key`` lives."""
        return f"{self._dir_s}/{key[:1].hex()}/{key.hex()}{SUFFIX}"

    def _io_error(self, what: str, e: OSError) -> None:
        self.count(errors=1)
        level = logging.WARNING if e.errno not in self._logged_errnos else logging.DEBUG
        self._logged_errnos.add(e.errno or 0)
        logger.log(level, "fs tier %s: cannot %s: %s", self.dir, what, e)

    # -- the StorageBackend interface ----------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> int:
        run = 0
        for k in keys:
            try:
                st = os.stat(self.path_of(k))
            except FileNotFoundError:
                break
            except OSError as e:
                self._io_error("look up a chunk", e)
                break
            if st.st_size != self.stored_bytes:
                break  # not a chunk of this codec: get() removes it
            run += 1
        return run

    def _read(
        self, key: bytes, out: memoryview, on_wait: Callable[[], None] | None
    ) -> int | OSError:
        # Per chunk: open, one vectored read, the hash, close. A page-cache read is a memory
        # copy, so every syscall and line of Python here shows (with two reading threads each
        # one is also a GIL hand-off): the file's size is told by the read's count (a byte past
        # the chunk is asked for too) and its mtime is not needed (``_touch_due``).
        path = self.path_of(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return _MISS
        except OSError as e:
            return e
        try:
            header = self._header_buffer()
            bufs = [header, out, self._past_end]
            done = 0
            if on_wait is not None:
                done = self._read_cached(fd, bufs)
                if done < self.stored_bytes:
                    on_wait()  # the rest waits on the device
            if done < self.stored_bytes:  # the rest, after what the page cache gave
                views = [memoryview(b).cast("B") for b in bufs]
                advance(views, done)
                done += preadv_until_full(fd, views, done)
            if done == self.stored_bytes:
                digest = self.codec.check_header(key, header)
                if digest is not None and payload_digest(out) == digest:
                    if self._touch_due(key):
                        _touch(fd)  # recently used: every instance's sweeper keeps it longer
                    return _HIT
            # A file evicted and reused while this read ran is a miss, not a bad chunk.
            return _CORRUPT if _names_inode(path, os.fstat(fd).st_ino) else _MISS
        except OSError as e:
            return e
        finally:
            os.close(fd)

    def _read_group(
        self, keys: Sequence[bytes], outs: list[memoryview], on_wait: Callable[[], None] | None
    ) -> list[int | OSError]:
        """What :meth:`_read` tells of each chunk, the files opened and read in C without the
        GIL (one release for the group, not three per file); verified here."""
        paths = [self.path_of(k) for k in keys]
        headers = self._header_buffer(len(keys))
        got = _fs_read.read_files(paths, headers, outs, self._past_end, on_wait)
        res: list[int | OSError] = []
        for i, (count, ino, digest_read) in enumerate(got):
            if count < 0:
                err = -count
                res.append(_MISS if err == errno.ENOENT else OSError(err, os.strerror(err)))
                continue
            if count == self.stored_bytes:
                header = headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
                digest = self.codec.check_header(keys[i], header)
                if digest is not None and digest == (digest_read or payload_digest(outs[i])):
                    if self._touch_due(keys[i]):
                        _touch(paths[i])  # recently used: every instance's sweeper keeps it
                    res.append(_HIT)
                    continue
            # A file evicted and reused while this read ran is a miss, not a bad chunk.
            res.append(_CORRUPT if _names_inode(paths[i], ino) else _MISS)
        return res

    def _touch_due(self, key: bytes) -> bool:
        """Whether a hit on ``key`` should set its file's mtime: not if this instance wrote or
        touched it less than ``TOUCH_AFTER_S`` ago (remembered for the last ``_TOUCHED_MAX``
        keys; races between threads cost at most an extra touch)."""
        now = time.monotonic()
        last = self._touched.get(key)
        if last is not None and now - last < TOUCH_AFTER_S:
            return False
        if len(self._touched) >= _TOUCHED_MAX:
            self._touched.clear()
        self._touched[key] = now
        return True

    def _read_cached(self, fd: int, bufs: list[Any]) -> int:
        """Bytes read into ``bufs`` without waiting (``RWF_NOWAIT``: what the page cache holds
        from the file's start; 0 where the kernel or file system cannot tell)."""
        if not self._nowait:
            return 0
        try:
            return os.preadv(fd, bufs, 0, _RWF_NOWAIT)
        except BlockingIOError:
            return 0
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            self._nowait = False  # not on this file system: every read may wait
            return 0

    def get(
        self,
        keys: Sequence[bytes],
        outs: Sequence[memoryview],
        on_wait: Callable[[], None] | None = None,
    ) -> list[bool]:
        n = len(keys)
        t0 = time.perf_counter()
        # In the caller's thread: a hand-off per chunk to another pool costs more than the
        # read of a chunk from the page cache (the storage worker shards reads over threads,
        # once ``on_wait`` says a read waits on the device).
        views = [memoryview(o).cast("B") for o in outs]
        if self.native_read:
            res = self._read_group(keys, views, on_wait)
        else:
            res = []
            waited: list[int] = []  # on_wait once per call, as the native read
            tell = None if on_wait is None else lambda: (waited.append(1), on_wait())
            for key, view in zip(keys, views, strict=True):
                res.append(self._read(key, view, None if waited else tell))
        dt = time.perf_counter() - t0
        corrupt = 0
        for k, r in zip(keys, res, strict=True):
            if isinstance(r, OSError):
                self._io_error("read a chunk", r)
            elif r == _CORRUPT:
                corrupt += 1
                logger.warning("fs tier: %s failed verification (removed)", self.path_of(k))
                self._unlink(self.path_of(k))
        ok = [r == _HIT for r in res]
        hits = sum(ok)
        self.count(
            hits=hits,
            misses=n - hits,
            corrupt=corrupt,
            read_bytes=hits * self.codec.payload_bytes,
            read_s=dt,
        )
        return ok

    def _write(self, key: bytes, payload: memoryview, header: bytes | None) -> int | OSError:
        path = self.path_of(key)
        try:
            if os.stat(path).st_size == self.stored_bytes:
                _touch(path)  # stored again: recently used
                self._touched[key] = time.monotonic()
                return _MISS  # already there (another instance wrote it): skipped
        except FileNotFoundError:
            pass
        except OSError as e:
            return e
        tmp = (
            f"{os.path.dirname(path)}/{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-"
            f"{os.urandom(4).hex()}"
        )
        direct = self.o_direct
        flags = os.O_WRONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            if header is None:
                header = self.codec.header(key, payload)
            reused = self._take_spare(tmp)  # an evicted file of the same size, overwritten
            if reused:
                fd = os.open(tmp, flags)
            else:
                flags |= os.O_CREAT | os.O_EXCL
                try:
                    fd = os.open(tmp, flags, 0o644)
                except FileNotFoundError:  # the namespace was deleted under us: make it again
                    self._make_dirs()
                    fd = os.open(tmp, flags, 0o644)
        except OSError as e:
            return e
        try:
            try:
                if direct:
                    self._write_direct(fd, header, payload, reused)
                else:
                    pwritev_all(fd, [header, payload], 0)
                _touch(fd)
                if self.fsync:
                    os.fsync(fd)
                elif self.writeback:
                    start_writeback(fd)
            finally:
                os.close(fd)  # may report a deferred write error (network file systems)
            os.rename(tmp, path)  # atomic: readers see the old state or the whole file
            self._touched[key] = time.monotonic()
            return _HIT
        except OSError as e:
            self._unlink(tmp)
            return e

    def _write_direct(self, fd: int, header: bytes, payload: memoryview, reused: bool) -> None:
        """Header and payload into ``fd`` (opened with O_DIRECT): the first
        :attr:`direct_bytes` from this thread's aligned buffer, direct; the tail buffered.
        A write the file system refuses (EINVAL: it took O_DIRECT at start, not now) is made
        buffered, and so are the later ones."""
        n = self.direct_bytes
        buf = self._bounce()
        buf[:HEADER_BYTES] = header
        buf[HEADER_BYTES:n] = payload[: n - HEADER_BYTES]
        tail = payload[n - HEADER_BYTES :]
        if reused and len(tail):
            # Free the old last block: the tail is then appended (a new page, zeroed), never
            # written into a block the kernel would first have to read.
            os.ftruncate(fd, n)
        try:
            pwritev_all(fd, [buf], 0)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.o_direct = self._o_direct_ok = False
            logger.warning("fs tier %s: O_DIRECT write refused (%s): buffered", self.dir, e)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            pwritev_all(fd, [header, payload], 0)
            return
        if len(tail):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            pwritev_all(fd, [tail], n)

    def _take_spare(self, tmp: str) -> bool:
        """Move a spare file (an evicted chunk's) to ``tmp``, claiming it: a rename is atomic,
        so of writers (and instances) trying one file one gets it. False when none is left
        (the directory is listed again at most every ``SPARE_RELIST_S``)."""
        while True:
            try:
                name = self._spares.popleft()
            except IndexError:
                now = time.monotonic()
                if now - self._spares_listed < SPARE_RELIST_S:
                    return False
                self._spares_listed = now
                try:
                    names = os.listdir(self._spare_dir)
                except OSError:
                    return False
                if not names:
                    return False
                self._spares.extend(names)
                continue
            try:
                os.rename(f"{self._spare_dir}/{name}", tmp)
                return True
            except FileNotFoundError:
                continue  # taken by another writer, or deleted by a sweep
            except OSError:
                return False

    def put(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        headers: Sequence[bytes] | None = None,
    ) -> list[bool]:
        n = len(keys)
        t0 = time.perf_counter()
        # In the caller's thread: the storage worker owns write concurrency and runs writes at
        # low CPU priority (a pool thread here would not be).
        res = [
            self._write(keys[i], memoryview(payloads[i]).cast("B"), headers and headers[i])
            for i in range(n)
        ]
        dt = time.perf_counter() - t0
        written = skipped = 0
        for r in res:
            if isinstance(r, OSError):
                self._io_error("write a chunk", r)
            elif r == _HIT:
                written += 1
            else:
                skipped += 1
        nbytes = written * self.stored_bytes
        self.count(
            written=written,
            write_bytes=written * self.codec.payload_bytes,
            write_s=dt,
            write_skipped=skipped,
        )
        with self._lock:
            self._written_since_sweep += nbytes
            early = self._sweep_due()
        if early:
            self._wake.set()
        return [not isinstance(r, OSError) for r in res]

    def writer_spec(self, options: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Retention moves with the writes: the writer process sweeps (at its low priority and
        off this process's GIL: a sweep lists and stats every file of the namespace, ~25 ms of
        Python per 3,000 files), this instance stops its sweeper and takes the namespace's
        usage from the writer's acknowledgements (:meth:`end_put`)."""
        self._stop_sweeper()
        return dict(options), []

    def take_stats(self) -> dict[str, float]:
        out = super().take_stats()
        if self._sweeper is not None:  # this instance applies retention: it knows the usage
            out[USAGE_STAT] = float(self.usage()[0])
        return out

    def end_put(
        self,
        keys: Sequence[bytes],
        targets: Sequence[int | None],
        ok: Sequence[bool],
        stats: dict[str, float],
    ) -> list[bool]:
        stats = dict(stats)
        used = stats.pop(USAGE_STAT, None)
        out = super().end_put(keys, targets, ok, stats)
        early = False
        with self._lock:
            if used is not None:  # the writer process sweeps: its usage is the namespace's
                self._used, self._written_since_sweep = int(used), 0
            else:  # bytes a writer process put here bring this instance's next sweep forward
                self._written_since_sweep += int(stats.get("written", 0)) * self.stored_bytes
                early = self._sweep_due()
        if early:
            self._wake.set()
        return out

    def remove(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._unlink(self.path_of(k))

    def _unlink(self, path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False  # another instance got there first
        except OSError as e:
            self._io_error("delete a file", e)
            return False

    def _sweep_due(self) -> bool:
        """Whether this instance's writes since the last sweep call for one now (``_lock``
        held): ``sweep_after`` bytes at least, and the namespace over ``size`` as the last
        sweep found it plus these writes (else it would evict nothing), or ``SWEEP_RESCAN``
        times ``sweep_after`` (other instances' writes show only in a listing)."""
        written = self._written_since_sweep
        if not 0 < self.sweep_after < written:
            return False
        return self._used + written > self.size_bytes or written > SWEEP_RESCAN * self.sweep_after

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return self._used + self._written_since_sweep, self.size_bytes

    # -- retention -----------------------------------------------------------------------------
    def _sweep_loop(self) -> None:
        lower_thread_priority()
        while not self._stop.is_set():
            self._wake.wait(self.sweep_interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.sweep()
            except Exception:  # the next sweep tries again
                logger.exception("fs tier %s: sweep failed", self.dir)

    def sweep(self) -> int:
        """Apply the retention limit now: evict the least recently used chunk files while the
        namespace holds more than ``size`` (down to 90% of it), and delete temporary files of
        writers that died. An evicted file becomes a spare, which a later write reuses
        instead of creating a file (no inode allocated and freed per chunk: on ext4 without a
        journal, allocation scans every inode freed in the last minutes, ~40% of a writer's
        CPU under a steady stream), up to ``spare_limit`` spares; beyond, it is deleted.
        Returns the number of chunk files evicted."""
        with self._sweep_lock:
            with self._lock:
                counted = self._written_since_sweep  # in the listing below from now on
            now = time.time()
            files: list[tuple[int, int, str]] = []  # (mtime ns, bytes, path)
            total = 0
            spares = self._sweep_spares()
            try:
                subdirs = [
                    e.path for e in os.scandir(self.dir) if e.is_dir() and e.name != SPARE_DIR
                ]
            except FileNotFoundError:
                subdirs = []
            except OSError as e:
                self._io_error("list the namespace", e)
                with self._lock:
                    self._written_since_sweep -= counted
                return 0
            for sub in subdirs:
                try:
                    entries = list(os.scandir(sub))
                except OSError as e:
                    if not isinstance(e, FileNotFoundError):
                        self._io_error("list a directory", e)
                    continue
                for e in entries:
                    try:
                        st = e.stat()
                    except OSError:
                        continue  # deleted meanwhile
                    if e.name.startswith(TMP_PREFIX):
                        if now - st.st_mtime > TMP_MAX_AGE_S:
                            self._unlink(e.path)
                    elif e.name.endswith(SUFFIX):
                        files.append((st.st_mtime_ns, st.st_size, e.path))
                        total += st.st_size
            deleted = 0
            if total > self.size_bytes:
                target = int(self.size_bytes * SWEEP_LOW_WATER)
                files.sort()
                for _, nbytes, path in files:
                    if total <= target:
                        break
                    spare = nbytes == self.stored_bytes and spares < self.spare_limit
                    if self._retire(path) if spare else self._unlink(path):
                        deleted += 1
                        spares += spare
                    total -= nbytes  # evicted here or by another instance's sweep
                self.count(evicted=deleted)
                logger.debug("fs tier %s: swept %d files", self.dir, deleted)
            with self._lock:
                self._used = total
                self._written_since_sweep -= counted
            return deleted

    def _sweep_spares(self) -> int:
        """The spare files left after deleting those over ``spare_limit`` (and any of another
        size); their number."""
        try:
            entries = list(os.scandir(self._spare_dir))
        except FileNotFoundError:
            return 0
        except OSError as e:
            self._io_error("list the spare files", e)
            return self.spare_limit  # unknown: make no more
        kept = 0
        for e in entries:
            try:
                size = e.stat().st_size
            except OSError:
                continue  # taken meanwhile
            if size == self.stored_bytes and kept < self.spare_limit:
                kept += 1
            else:
                self._unlink(e.path)
        return kept

    def _retire(self, path: str) -> bool:
        """Move an evicted chunk file to the spare directory (True), or False when it is gone
        already (another instance's sweep); deleted when it cannot be moved."""
        name = f"{os.getpid()}-{os.urandom(6).hex()}"
        try:
            os.rename(path, f"{self._spare_dir}/{name}")
        except FileNotFoundError:
            return False
        except OSError:
            return self._unlink(path)
        self._spares.append(name)
        return True

    def _stop_sweeper(self) -> None:
        sweeper, self._sweeper = self._sweeper, None
        self._stop.set()
        self._wake.set()
        if sweeper is not None and sweeper.is_alive() and sweeper is not threading.current_thread():
            sweeper.join()

    def close(self) -> None:
        self._stop_sweeper()
