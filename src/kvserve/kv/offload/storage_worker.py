"""The storage worker: asynchronous I/O between the host tier and the storage tiers below it.

Owns the I/O threads and the storage operations in flight; knows tiers, keys and host-memory
buffers, never requests, slots' meaning or eviction. Three kinds of operation, each submitted
by the offloading connector and reported back through :meth:`poll` (never blocking the step):

- lookup: the leading run of chunk keys held by the tier chain (tier 0 first; the keys a tier
  lacks are looked up in the next one), answered as one source tier per leading chunk;
- read: chunks copied from their source tier straight into host-tier slots (the staging of a
  lower-tier hit), each verified by its tier (header + full-content hash);
- write: the cascade of chunks just stored in the host tier to every storage tier.

Lookups and reads (requests wait for them) run on one pool of threads, writes on another
smaller pool behind a bounded queue: a write that finds the queue full is dropped and counted
(a future miss, never a wait), so a slow tier cannot delay loads or the engine.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvserve.kv.backends.storage import StorageBackend, lower_thread_priority

logger = logging.getLogger(__name__)


@dataclass
class StorageResult:
    """One finished operation. ``sources``: per leading chunk of a lookup, its tier index;
    ``ok``: per chunk of a read, or per chunk of a write (present in at least one tier
    afterwards); ``stored``: per tier, the keys a write put there."""

    op_id: int
    kind: str  # "lookup" | "read" | "write"
    sources: list[int] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)
    stored: dict[int, list[bytes]] = field(default_factory=dict)
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class ReadItem:
    """Chunk ``key`` from tier ``tier`` into ``dest`` (a host-tier slot's bytes)."""

    tier: int
    key: bytes
    dest: memoryview


class StorageWorker:
    """Thread pools running storage operations; results are collected by :meth:`poll`."""

    def __init__(
        self,
        tiers: Sequence[StorageBackend],
        *,
        io_threads: int = 4,
        write_threads: int = 2,
        max_pending_writes: int = 256,  # chunks
        read_batch: int = 8,  # chunks per get() call (one pipeline / one thread's share)
    ) -> None:
        if not tiers:
            raise ValueError("the storage worker needs at least one tier")
        self.tiers = list(tiers)
        self.max_pending_writes = max_pending_writes
        self.read_batch = read_batch
        self._reads = ThreadPoolExecutor(io_threads, thread_name_prefix="kv-storage-io")
        # Writes run at the lowest CPU priority: on a CPU engine they would otherwise take
        # cores from the forward pass (hashing, copies, syscalls); nobody waits for them.
        self._writes = ThreadPoolExecutor(
            write_threads, thread_name_prefix="kv-storage-write", initializer=lower_thread_priority
        )
        self._cond = threading.Condition()
        self._results: list[StorageResult] = []
        self._inflight = 0
        self._pending_write_chunks = 0
        self._ids = itertools.count(1)
        self._closed = False

    # -- submission (engine thread) ------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Start a lookup of ``keys`` (in prefix order); returns its op id."""
        op = next(self._ids)
        self._start(self._reads, op, "lookup", lambda: self._lookup(op, list(keys)))
        return op

    def lookup_now(self, keys: Sequence[bytes]) -> list[int]:
        """The same as :meth:`lookup`, in the calling thread (tiers that look up in memory)."""
        return self._lookup(0, list(keys)).sources

    def read(self, items: Sequence[ReadItem]) -> int:
        """Start reading ``items`` into their destinations; returns its op id. A tier's chunks
        are read in batches of ``read_batch`` (one ``get`` call each), the batches spread over
        the I/O threads; the result is published when the last batch ends."""
        op = next(self._ids)
        items = list(items)
        groups: list[list[int]] = []
        for i, item in enumerate(items):
            last = groups[-1] if groups else None
            if last and items[last[0]].tier == item.tier and len(last) < self.read_batch:
                last.append(i)
            else:
                groups.append([i])
        ok = [False] * len(items)
        remaining = [len(groups)]
        with self._cond:
            if self._closed:
                raise RuntimeError("storage worker is shut down")
            self._inflight += 1
        t0 = time.perf_counter()

        def run(group: list[int]) -> None:
            try:
                tier = self.tiers[items[group[0]].tier]
                got = tier.get([items[i].key for i in group], [items[i].dest for i in group])
                for i, g in zip(group, got, strict=True):
                    ok[i] = bool(g)
            except Exception:  # a tier bug: these chunks are misses
                logger.exception("KV storage read %d failed", op)
            with self._cond:
                remaining[0] -= 1
                if remaining[0]:
                    return
                nbytes = sum(len(items[i].dest) for i in range(len(items)) if ok[i])
                self._inflight -= 1
                self._results.append(
                    StorageResult(
                        op, "read", ok=ok, nbytes=nbytes, seconds=time.perf_counter() - t0
                    )
                )
                self._cond.notify_all()

        if not groups:
            with self._cond:
                self._inflight -= 1
                self._results.append(StorageResult(op, "read"))
                self._cond.notify_all()
        for g in groups:
            self._reads.submit(run, g)
        return op

    def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int | None:
        """Start writing chunks to every tier; None (dropped, counted by each tier) when the
        write queue is full. The payloads must stay valid until the result is polled."""
        n = len(keys)
        with self._cond:
            if self._closed or self._pending_write_chunks + n > self.max_pending_writes:
                for tier in self.tiers:
                    tier.count(dropped=n)
                return None
            self._pending_write_chunks += n
        op = next(self._ids)
        keys, payloads = list(keys), list(payloads)
        self._start(self._writes, op, "write", lambda: self._write(op, keys, payloads))
        return op

    def _start(
        self, pool: ThreadPoolExecutor, op: int, kind: str, fn: Callable[[], StorageResult]
    ) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("storage worker is shut down")
            self._inflight += 1

        def run() -> None:
            t0 = time.perf_counter()
            try:
                result = fn()
            except Exception:  # a tier bug must not lose the operation: it is a miss
                logger.exception("KV storage %s %d failed", kind, op)
                result = StorageResult(op, kind)
            result.seconds = time.perf_counter() - t0
            with self._cond:
                self._inflight -= 1
                if kind == "write":
                    self._pending_write_chunks -= len(result.ok)
                self._results.append(result)
                self._cond.notify_all()

        pool.submit(run)

    # -- collection (engine thread) ------------------------------------------------------------
    def poll(self) -> list[StorageResult]:
        with self._cond:
            out, self._results = self._results, []
        return out

    def has_inflight(self) -> bool:
        return self._inflight > 0

    def has_results(self) -> bool:
        return bool(self._results)

    def wait_any(self, timeout: float) -> None:
        """Block until a result is ready, nothing is in flight, or ``timeout`` passed."""
        with self._cond:
            self._cond.wait_for(lambda: self._results or not self._inflight, timeout)

    def shutdown(self) -> None:
        """Stop taking work, let running operations end (their results are discarded)."""
        with self._cond:
            self._closed = True
        self._reads.shutdown(wait=True, cancel_futures=True)
        self._writes.shutdown(wait=True, cancel_futures=True)
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                logger.exception("closing KV tier %s failed", tier.tier_id)

    # -- the operations (I/O threads) ----------------------------------------------------------
    def _lookup(self, op: int, keys: list[bytes]) -> StorageResult:
        sources: list[int] = []
        for t, tier in enumerate(self.tiers):
            rest = keys[len(sources) :]
            if not rest:
                break
            tier.count(lookups=len(rest))
            n = tier.exists(rest)
            sources.extend([t] * n)
        return StorageResult(op, "lookup", sources=sources)

    def _write(self, op: int, keys: list[bytes], payloads: list[memoryview]) -> StorageResult:
        present = [False] * len(keys)
        stored: dict[int, list[bytes]] = {}
        for t, tier in enumerate(self.tiers):
            res = tier.put(keys, payloads)
            stored[t] = [k for k, r in zip(keys, res, strict=True) if r]
            present = [p or bool(r) for p, r in zip(present, res, strict=True)]
        nbytes = sum(len(p) for p in payloads)
        return StorageResult(op, "write", ok=present, stored=stored, nbytes=nbytes)
