"""The ``disk`` tier: one preallocated file of fixed chunk slots in a local directory, private
to one engine instance.

Owns the slot file (``kvserve-<codec.namespace>.slots``: a model or layout change opens another
file, never reads old chunks), the in-memory index (key -> slot, LRU), the pinning of slots
being read, and the rebuild of the index from the slots' headers when an instance restarts on
the same file. Options (``disk:path=/var/kv,size=64``): ``path`` (directory), ``size`` (GiB or
``512MiB``), ``o_direct`` (``auto``: O_DIRECT where the file system allows it, else buffered
I/O that drops its pages after each slot; ``true``: required; ``false``), ``io_threads``
(threads reading the slots' headers when the index is rebuilt at start). Reads and writes run
in the caller's thread: the storage worker owns their concurrency (each of its I/O threads
reads one contiguous shard of a staging read).

A slot is ``align(codec.stored_bytes, 4096)`` bytes and holds the codec's header and payload,
payload first::

    payload (payload_bytes) | header (HEADER_BYTES, ChunkCodec.header) | zero padding

so that with O_DIRECT a page-aligned destination of a whole number of pages is read into (and
written from) directly, the header coming from the page after it in the same ``preadv``; any
other buffer goes through a page-aligned bounce buffer. A slot enters the index only after its
write completed, and a slot being read is never handed to a writer, so a reader never sees a
torn chunk; a write cut short by a crash leaves a header whose hash the payload fails.

The file is locked (``flock``) while open: a second instance on the same directory gets a clear
error instead of overwriting this one's slots. Stale slot files of other models in the same
directory are deleted at start (the directory is this tier's, bounded by ``size``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.kv.backends import register_backend
from kvserve.kv.backends.chunk_format import HEADER_BYTES, ChunkCodec, payload_digest
from kvserve.kv.backends.storage import StorageBackend, parse_flag, parse_size

logger = logging.getLogger(__name__)

PAGE = 4096  # slot, offset and buffer alignment (O_DIRECT's strictest common requirement)
# Where chunk_format's header holds the chunk key: magic (4s), version (u16), layout length
# (u16), payload length (u64), xxh3-128 (16s), then the 32-byte key.
_KEY_OFFSET = 32
_KEY_BYTES = 32
_SUFFIX = ".slots"
_PREFIX = "kvserve-"


def align_up(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


def header_key(header: memoryview | bytes) -> bytes | None:
    """The chunk key a stored header names, read without knowing it in advance (the index
    rebuild); None when too short. ``codec.check_header(key, header)`` then checks the rest."""
    if len(header) < HEADER_BYTES:
        return None
    return bytes(header[_KEY_OFFSET : _KEY_OFFSET + _KEY_BYTES])


def parse_o_direct(value: Any) -> bool | None:
    """``auto`` (None), or a boolean from a bool or a CLI string."""
    if value is None or isinstance(value, bool):
        return value
    if str(value).strip().lower() == "auto":
        return None
    try:
        return parse_flag(value, "o_direct")
    except ValueError:
        raise ValueError(
            f"disk tier: o_direct must be auto, true or false, got {value!r}"
        ) from None


def buffer_address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def pwritev_all(fd: int, bufs: Sequence[memoryview | bytes], offset: int) -> None:
    """``pwritev`` until every byte is written (a short write continues where it stopped)."""
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += n
        advance(views, n)


def preadv_all(fd: int, bufs: Sequence[memoryview | bytearray | mmap.mmap], offset: int) -> bool:
    """``preadv`` until every buffer is full; False when the file ends first."""
    views = [memoryview(b).cast("B") for b in bufs]
    want = sum(v.nbytes for v in views)
    return preadv_until_full(fd, views, offset) == want


def preadv_until_full(fd: int, views: list[memoryview], offset: int) -> int:
    """Bytes read into ``views`` (byte views, consumed as they fill) from ``offset`` until they
    are full or the file ends."""
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n <= 0:
            break
        total += n
        advance(views, n)
    return total


def advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from ``views`` after a partial vectored read or write."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if n:
        views[0] = views[0][n:]


class _SlotRead:
    """Outcome of one slot read: a verified hit, a chunk that failed verification, or an
    I/O error."""

    __slots__ = ("ok", "error")

    def __init__(self, ok: bool, error: OSError | None = None) -> None:
        self.ok = ok
        self.error = error


class _SlotIO:
    """Buffers and slot writes over one slot file (the tier's, or a writer process's
    inherited descriptor of it). Needs ``fd``, ``codec``, ``payload_bytes``, ``slot_bytes``,
    ``o_direct``, ``_zero_copy_ok`` and ``_tls``."""

    fd: int
    codec: ChunkCodec
    payload_bytes: int
    slot_bytes: int
    o_direct: bool
    _zero_copy_ok: bool
    _tls: threading.local

    def _bounce(self) -> mmap.mmap:
        buf = getattr(self._tls, "bounce", None)
        if buf is None:
            buf = self._tls.bounce = mmap.mmap(-1, self.slot_bytes)
        return buf

    def _page(self) -> mmap.mmap:
        buf = getattr(self._tls, "page", None)
        if buf is None:
            buf = self._tls.page = mmap.mmap(-1, 2 * PAGE)
        return buf

    def _zero_copy(self, buf: memoryview) -> bool:
        return self._zero_copy_ok and buffer_address(buf) % PAGE == 0

    def _write_slot(
        self, slot: int, key: bytes, payload: memoryview, header: bytes | None
    ) -> OSError | None:
        off = slot * self.slot_bytes
        n = self.payload_bytes
        try:
            if header is None:
                header = self.codec.header(key, payload)
            if not self.o_direct:
                pwritev_all(self.fd, [payload, header], off)
                os.posix_fadvise(self.fd, off, self.slot_bytes, os.POSIX_FADV_DONTNEED)
            elif self._zero_copy(payload):
                page = memoryview(self._page())[:PAGE]
                page[:HEADER_BYTES] = header
                page[HEADER_BYTES:] = bytes(PAGE - HEADER_BYTES)
                pwritev_all(self.fd, [payload, page], off)
            else:
                buf = memoryview(self._bounce())
                buf[:n] = payload
                buf[n : n + HEADER_BYTES] = header
                buf[n + HEADER_BYTES :] = bytes(self.slot_bytes - n - HEADER_BYTES)
                pwritev_all(self.fd, [buf], off)
            return None
        except OSError as e:
            return e


class DiskSlotWriter(_SlotIO):
    """A disk tier's write side in a writer process: writes chunks into the slots the engine's
    index chose (:meth:`DiskBackend.begin_put`) through the slot file's inherited descriptor
    (its O_DIRECT flag included); the engine publishes them (:meth:`DiskBackend.end_put`)."""

    def __init__(self, codec: ChunkCodec, fd: int, slot_bytes: int, o_direct: bool) -> None:
        self.fd, self.codec = fd, codec
        self.payload_bytes, self.slot_bytes, self.o_direct = (
            codec.payload_bytes,
            slot_bytes,
            o_direct,
        )
        self._zero_copy_ok = o_direct and self.payload_bytes % PAGE == 0
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._stats: dict[str, float] = {}
        self._logged_errnos: set[int] = set()

    def put_planned(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        headers: Sequence[bytes] | None,
        targets: Sequence[int | None],
    ) -> list[bool]:
        ok = [False] * len(keys)
        t0 = time.perf_counter()
        written = errors = 0
        for i, slot in enumerate(targets):
            if slot is None or slot < 0:
                continue
            err = self._write_slot(slot, keys[i], memoryview(payloads[i]).cast("B"),
                                   headers[i] if headers else None)  # fmt: skip
            if err is None:
                ok[i] = True
                written += 1
            else:
                errors += 1
                level = logging.WARNING if err.errno not in self._logged_errnos else logging.DEBUG
                self._logged_errnos.add(err.errno or 0)
                logger.log(level, "disk tier writer: cannot write a slot: %s", err)
        with self._lock:
            st = self._stats
            for k, v in (("written", written), ("write_bytes", written * self.payload_bytes),
                         ("write_s", time.perf_counter() - t0), ("errors", errors)):  # fmt: skip
                st[k] = st.get(k, 0) + v
        return ok

    def take_stats(self) -> dict[str, float]:
        with self._lock:
            out, self._stats = self._stats, {}
        return {k: v for k, v in out.items() if v}

    def close(self) -> None:
        os.close(self.fd)


@register_backend("disk")
class DiskBackend(_SlotIO, StorageBackend):
    """Fixed slots in one preallocated local file; an in-memory LRU index of key -> slot."""

    name = "disk"
    locality = "LOCAL"
    shared = False
    lookup_in_memory = True

    def __init__(
        self,
        codec: ChunkCodec,
        *,
        tier_id: str | None = None,
        path: str | os.PathLike,
        size: Any,
        o_direct: Any = "auto",
        io_threads: Any = 4,
    ) -> None:
        super().__init__(codec, tier_id=tier_id)
        self.dir = Path(path)
        self.payload_bytes = codec.payload_bytes
        self.slot_bytes = align_up(codec.stored_bytes)
        size_bytes = parse_size(size)
        self.num_slots = size_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"disk tier size {size_bytes} bytes is smaller than one chunk slot "
                f"({self.slot_bytes} bytes); raise size"
            )
        self.capacity_bytes = self.num_slots * self.slot_bytes
        self.path = self.dir / f"{_PREFIX}{codec.namespace}{_SUFFIX}"
        want_direct = parse_o_direct(o_direct)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"disk tier: cannot create {self.dir}: {e.strerror}") from e
        self._delete_stale_files()
        existed = self.path.exists()
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise OSError(e.errno, f"disk tier: cannot open {self.path}: {e.strerror}") from e
        try:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(
                    f"disk tier: {self.path} is in use by another process; give each "
                    "instance its own directory (the fs tier is the shared one)"
                ) from None
            self._preallocate(existed)
            self.o_direct = self._enable_o_direct(want_direct)
        except BaseException:
            os.close(self.fd)
            raise
        self._zero_copy_ok = self.o_direct and self.payload_bytes % PAGE == 0
        # Region holding the header, as read and written under O_DIRECT (page aligned).
        self._hdr_lo = self.payload_bytes // PAGE * PAGE
        self._hdr_hi = align_up(self.payload_bytes + HEADER_BYTES)
        self._zeros = mmap.mmap(-1, self._hdr_hi - self._hdr_lo)  # retires a slot's header
        self._tls = threading.local()
        self._rebuild_threads = int(io_threads)
        # Index state (under _cond): key -> slot in LRU order (oldest first), free slots, pins of
        # slots being read, keys being written, slots forgotten while pinned.
        self._cond = threading.Condition()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._free: list[int] = []
        self._pins = [0] * self.num_slots
        self._writing: dict[bytes, int] = {}
        self._doomed: set[int] = set()
        self._inflight = 0
        self._closed = False
        self._logged_errnos: set[int] = set()
        self._rebuild()

    # -- start-up ------------------------------------------------------------------------------
    def _delete_stale_files(self) -> None:
        """Slot files of other models or layouts in this directory that no instance holds."""
        for p in self.dir.glob(f"{_PREFIX}*{_SUFFIX}"):
            if p == self.path:
                continue
            try:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                size = os.fstat(fd).st_size
                p.unlink()
                logger.info("disk tier: deleted %s (%d bytes, another model or layout)", p, size)
            except OSError:
                pass  # held by a running instance, or not ours to delete
            finally:
                os.close(fd)

    def _preallocate(self, existed: bool) -> None:
        st = os.fstat(self.fd)
        old_size = st.st_size
        if old_size > self.capacity_bytes:
            os.ftruncate(self.fd, self.capacity_bytes)  # the tier shrank: drop the tail slots
        if old_size >= self.capacity_bytes and st.st_blocks * 512 >= self.capacity_bytes:
            return
        try:
            os.posix_fallocate(self.fd, 0, self.capacity_bytes)
        except OSError as e:
            if existed:
                os.ftruncate(self.fd, old_size)
            else:
                os.unlink(self.path)
            try:
                vfs = os.statvfs(self.dir)
                free = f"{vfs.f_bavail * vfs.f_frsize} bytes free"
            except OSError:
                free = "free space unknown"
            raise OSError(
                e.errno,
                f"disk tier: cannot preallocate {self.capacity_bytes} bytes in {self.dir} "
                f"({free}): {e.strerror}; lower size or free space",
            ) from e

    def _enable_o_direct(self, want: bool | None) -> bool:
        """Turn O_DIRECT on for the open file (``F_SETFL``) and prove it with one aligned read;
        fall back to buffered I/O where the file system refuses it (``auto``)."""
        if want is False or not hasattr(os, "O_DIRECT"):
            logger.info("disk tier %s: buffered I/O (o_direct=false)", self.path)
            return False
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        probe = mmap.mmap(-1, PAGE)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | os.O_DIRECT)
            os.preadv(self.fd, [probe], 0)
        except OSError as e:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags)
            if want:
                raise OSError(
                    e.errno, f"disk tier: O_DIRECT refused on {self.path}: {e.strerror}"
                ) from e
            logger.info(
                "disk tier %s: O_DIRECT refused by the file system (%s): buffered I/O, pages "
                "dropped after each slot",
                self.path,
                e.strerror,
            )
            return False
        finally:
            probe.close()
        logger.info("disk tier %s: O_DIRECT", self.path)
        return True

    def _rebuild(self) -> None:
        """Index the slots a previous run left (header parsed with its own key and checked
        against this codec); the others are free. Payloads are verified when read."""
        t0 = time.perf_counter()
        kept: list[tuple[int, bytes]] = []

        def probe(slot: int) -> bytes | None:
            try:
                header = self._read_header(slot)
            except OSError:
                return None
            key = header_key(header)
            if key is None or self.codec.check_header(key, header) is None:
                return None
            return key

        if self._rebuild_threads > 1 and self.num_slots > 1:
            with ThreadPoolExecutor(self._rebuild_threads, thread_name_prefix="kv-disk") as pool:
                keys = list(pool.map(probe, range(self.num_slots)))
        else:
            keys = [probe(s) for s in range(self.num_slots)]
        for slot, key in enumerate(keys):
            if key is not None and key not in self._index:
                self._index[key] = slot
                kept.append((slot, key))
        held = {slot for slot, _ in kept}
        self._free = [s for s in reversed(range(self.num_slots)) if s not in held]
        logger.info(
            "disk tier %s: %d slots of %d bytes (%s), %d chunks kept from a previous run (%.2f s)",
            self.path,
            self.num_slots,
            self.slot_bytes,
            "O_DIRECT" if self.o_direct else "buffered",
            len(kept),
            time.perf_counter() - t0,
        )

    # -- buffers and slot I/O (outside the lock) -----------------------------------------------
    def _read_header(self, slot: int) -> memoryview | bytes:
        off = slot * self.slot_bytes
        if not self.o_direct:
            return os.pread(self.fd, HEADER_BYTES, off + self.payload_bytes)
        page = memoryview(self._page())
        n = self._hdr_hi - self._hdr_lo
        if not preadv_all(self.fd, [page[:n]], off + self._hdr_lo):
            raise OSError(errno.EIO, "slot file shorter than its geometry")
        start = self.payload_bytes - self._hdr_lo
        return page[start : start + HEADER_BYTES]

    def _check(self, key: bytes, header: memoryview | bytes, payload: memoryview) -> bool:
        digest = self.codec.check_header(key, header)
        return digest is not None and payload_digest(payload) == digest

    def _read_slot(self, slot: int, key: bytes, out: memoryview) -> _SlotRead:
        off = slot * self.slot_bytes
        try:
            if not self.o_direct:
                header = bytearray(HEADER_BYTES)
                full = preadv_all(self.fd, [out, header], off)
                os.posix_fadvise(self.fd, off, self.slot_bytes, os.POSIX_FADV_DONTNEED)
                return _SlotRead(full and self._check(key, header, out))
            if self._zero_copy(out):
                page = memoryview(self._page())[:PAGE]
                full = preadv_all(self.fd, [out, page], off)
                return _SlotRead(full and self._check(key, page[:HEADER_BYTES], out))
            buf = memoryview(self._bounce())
            full = preadv_all(self.fd, [buf], off)
            n = self.payload_bytes
            if not (full and self._check(key, buf[n : n + HEADER_BYTES], buf[:n])):
                return _SlotRead(False)
            out[:] = buf[:n]  # copied only once verified
            return _SlotRead(True)
        except OSError as e:
            return _SlotRead(False, e)

    def _retire(self, slots: Iterable[int]) -> None:
        """Zero the headers of forgotten slots (a restart must not bring them back), then free
        them."""
        slots = list(slots)
        if not slots:
            return
        for slot in slots:
            off = slot * self.slot_bytes
            try:
                if self.o_direct:
                    pwritev_all(self.fd, [self._zeros], off + self._hdr_lo)
                else:
                    pwritev_all(self.fd, [bytes(HEADER_BYTES)], off + self.payload_bytes)
            except OSError as e:
                self._io_error("retire a slot", e)
        with self._cond:
            self._free.extend(slots)

    def _io_error(self, what: str, e: OSError) -> None:
        self.count(errors=1)
        level = logging.WARNING if e.errno not in self._logged_errnos else logging.DEBUG
        self._logged_errnos.add(e.errno or 0)
        logger.log(level, "disk tier %s: cannot %s: %s", self.path, what, e)

    def _enter(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._inflight += 1
            return True

    def _leave(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    # -- the StorageBackend interface ----------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> int:
        with self._cond:
            run = 0
            for k in keys:
                if k not in self._index:
                    break
                run += 1
        return run

    def get(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[bool]:
        n = len(keys)
        if not self._enter():
            self.count(misses=n)
            return [False] * n
        try:
            with self._cond:
                slots: list[int | None] = []
                for k in keys:
                    s = self._index.get(k)
                    if s is not None:
                        self._pins[s] += 1
                        self._index.move_to_end(k)
                    slots.append(s)
            t0 = time.perf_counter()

            def one(i: int) -> _SlotRead | None:
                s = slots[i]
                if s is None:
                    return None
                return self._read_slot(s, keys[i], memoryview(outs[i]).cast("B"))

            # In the caller's thread: the storage worker runs one shard of a read per thread.
            reads = [one(i) for i in range(n)]
            dt = time.perf_counter() - t0
            ok = [r is not None and r.ok for r in reads]
            bad: set[int] = set()
            corrupt = 0
            for i, r in enumerate(reads):
                if r is None or r.ok:
                    continue
                bad.add(i)
                if r.error is not None:
                    self._io_error("read a slot", r.error)
                else:
                    corrupt += 1
                    logger.warning(
                        "disk tier %s: slot %d failed verification (removed)", self.path, slots[i]
                    )
            to_retire: list[int] = []
            with self._cond:
                for i, s in enumerate(slots):
                    if s is None:
                        continue
                    self._pins[s] -= 1
                    if i in bad and self._index.get(keys[i]) == s:
                        del self._index[keys[i]]
                        self._doomed.add(s)
                    if self._pins[s] == 0 and s in self._doomed:
                        self._doomed.discard(s)
                        to_retire.append(s)
            self._retire(to_retire)
            hits = sum(ok)
            self.count(
                hits=hits,
                misses=n - hits,
                corrupt=corrupt,
                read_bytes=hits * self.payload_bytes,
                read_s=dt,
            )
            return ok
        finally:
            self._leave()

    def put(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        headers: Sequence[bytes] | None = None,
    ) -> list[bool]:
        n = len(keys)
        if not self._enter():
            self.count(dropped=n)
            return [False] * n
        try:
            ok = [False] * n
            todo: list[tuple[int, int]] = []  # (index in keys, slot)
            others: list[int] = []  # keys another thread is writing
            first: dict[bytes, int] = {}  # repeated keys in this call follow the first
            evicted: list[bytes] = []
            skipped = dropped = 0
            with self._cond:
                for i, k in enumerate(keys):
                    if k in first:
                        continue
                    first[k] = i
                    if k in self._index:
                        self._index.move_to_end(k)
                        ok[i] = True
                        skipped += 1
                    elif k in self._writing:
                        others.append(i)
                        skipped += 1
                    else:
                        s = self._allocate(evicted)
                        if s is None:  # every slot is being read or written
                            dropped += 1
                            continue
                        self._writing[k] = s
                        todo.append((i, s))
            if evicted:
                self.note_evicted(evicted)
            t0 = time.perf_counter()
            # In the caller's thread: the storage worker owns write concurrency and runs
            # writes at low CPU priority (a pool thread here would not be).
            errs = [
                self._write_slot(
                    s, keys[i], memoryview(payloads[i]).cast("B"), headers and headers[i]
                )
                for i, s in todo
            ]
            dt = time.perf_counter() - t0
            failed = []
            with self._cond:
                for (i, s), err in zip(todo, errs, strict=True):
                    del self._writing[keys[i]]
                    if err is None:
                        self._index[keys[i]] = s
                        ok[i] = True
                    else:
                        self._free.append(s)
                        failed.append(err)
                self._cond.notify_all()
                # Keys another thread was writing: in the tier once that write is published.
                for i in others:
                    self._cond.wait_for(lambda k=keys[i]: k not in self._writing)
                    ok[i] = keys[i] in self._index
            for err in failed:
                self._io_error("write a slot", err)
            for i, k in enumerate(keys):
                ok[i] = ok[first[k]]
            written = len(todo) - len(failed)
            self.count(
                written=written,
                write_bytes=written * self.payload_bytes,
                write_s=dt,
                write_skipped=skipped,
                dropped=dropped,
            )
            return ok
        finally:
            self._leave()

    # -- writes made in a writer process (storage_writer) --------------------------------------
    def writer_spec(self, options: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """The writer process writes through this tier's own descriptor of the slot file."""
        return {"slot_bytes": self.slot_bytes, "o_direct": self.o_direct}, [self.fd]

    @classmethod
    def open_writer(
        cls, codec: ChunkCodec, options: dict[str, Any], fds: list[int]
    ) -> DiskSlotWriter:
        return DiskSlotWriter(codec, fds[0], int(options["slot_bytes"]), bool(options["o_direct"]))

    def begin_put(self, keys: Sequence[bytes]) -> list[int | None]:
        """Slots for the keys not held or being written (evicting as :meth:`put` does); they
        stay out of the index until :meth:`end_put`."""
        targets: list[int | None] = [None] * len(keys)
        evicted: list[bytes] = []
        skipped = dropped = 0
        with self._cond:
            if self._closed:
                dropped = len(keys)
            else:
                for i, k in enumerate(keys):
                    if k in self._index:
                        self._index.move_to_end(k)
                        skipped += 1
                    elif k in self._writing:
                        skipped += 1
                    else:
                        s = self._allocate(evicted)
                        if s is None:
                            dropped += 1
                            continue
                        self._writing[k] = s
                        targets[i] = s
        if evicted:
            self.note_evicted(evicted)
        self.count(write_skipped=skipped, dropped=dropped)
        return targets

    def end_put(
        self,
        keys: Sequence[bytes],
        targets: Sequence[int | None],
        ok: Sequence[bool],
        stats: dict[str, float],
    ) -> list[bool]:
        self.add_stats(stats)
        with self._cond:
            for k, s, good in zip(keys, targets, ok, strict=True):
                if s is None:
                    continue
                del self._writing[k]
                if good:
                    self._index[k] = s
                else:
                    self._free.append(s)
            self._cond.notify_all()
            return [k in self._index for k in keys]

    def _allocate(self, evicted: list[bytes]) -> int | None:
        """A free slot, else the least recently used one nobody is reading (under the lock)."""
        if self._free:
            return self._free.pop()
        for k, s in self._index.items():
            if self._pins[s] == 0:
                del self._index[k]
                evicted.append(k)
                return s
        return None

    def remove(self, keys: Sequence[bytes]) -> None:
        if not self._enter():
            return
        try:
            to_retire = []
            with self._cond:
                for k in keys:
                    s = self._index.pop(k, None)
                    if s is None:
                        continue
                    if self._pins[s]:
                        self._doomed.add(s)  # retired by its last reader
                    else:
                        to_retire.append(s)
            self._retire(to_retire)
        finally:
            self._leave()

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding ``key`` (tests and tools; offsets are ``slot * slot_bytes``)."""
        with self._cond:
            return self._index.get(key)

    def usage(self) -> tuple[int, int]:
        with self._cond:
            used = len(self._index) * self.slot_bytes
        return used, self.capacity_bytes

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.wait_for(lambda: self._inflight == 0)
        os.close(self.fd)  # releases the flock
