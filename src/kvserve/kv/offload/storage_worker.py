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

Reads: a tier's chunks of one read are cut into a few groups of contiguous chunks per I/O
thread; one task per thread takes groups until none is left, each read by one ``get`` call in
that thread (backends read in the caller's thread: no per-chunk hand-off between pools). A
read from tiers whose chunks may sit in the page cache (``fs``) starts with
``cached_read_threads`` tasks (two on a small machine: a copy from the page cache is bound by
memory bandwidth, but each chunk's hash is not, and xxh3 releases the GIL, so one thread hashes
while the other copies) and starts the others when a chunk has to wait on the device.

Writes go in batches of ``write_batch`` chunks, each batch to every tier in turn; each chunk's
header (its full-content hash) is made once for all tiers. The writer threads run under
``SCHED_IDLE`` (on cores the engine leaves idle), may be held to a duty cycle (``write_duty``)
and paused while the engine computes a step (:meth:`pause_writes` / :meth:`resume_writes`:
checked before each batch and each tier's part of it).

With a host tier in shared memory (``host``: ``CpuBackend(shared=True)``) and
``write_process``, writes run in a writer process instead
(:mod:`kvserve.kv.offload.storage_writer`): the same queue bound, drop counting, batching, duty
cycle, pause and policy, with only keys, offsets and each tier's targets crossing a socket.
If that process dies, later writes are dropped (counted in each tier's ``dropped`` and in
:attr:`StorageWorker.writer_lost_chunks`) and everything else goes on. Lookups and reads stay
in this process: a request waits for them, and they land in this process's host slots.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.cpu import usable_cores
from kvserve.kv.backends.storage import StorageBackend, TierSpec, lower_thread_priority
from kvserve.kv.offload.storage_writer import TierWriterSpec, WriterProcess, set_thread_policy

if TYPE_CHECKING:
    from kvserve.kv.backends.cpu import CpuBackend

logger = logging.getLogger(__name__)

# Longest a paused writer waits: a long step (a big prefill) or a pause never resumed must
# not hold the cascade back for good.
PAUSE_BOUND_S = 1.0
# Staging reads: groups of contiguous chunks per I/O thread, and the largest group.
READ_GROUPS_PER_THREAD = 2
MAX_READ_GROUP = 16
# Staging reads from the page cache: a copy bound by memory bandwidth, then the chunk's hash
# from the core's cache (xxh3 releases the GIL). Two threads overlap one's hash with the other's
# copy: on machine B (2 cores) a plain read copies 12-15 GB/s with one thread or four, a
# verified read 10 GB/s with one thread, 13 GB/s (a plain read's) with two. Beyond two, one
# thread per this many usable cores (more copies only contend for memory bandwidth).
MIN_CACHED_READ_THREADS = 2
CORES_PER_CACHED_READ_THREAD = 4
# Writer threads' scheduling (storage.lower_thread_priority): SCHED_IDLE, nice 19, unchanged.
WRITER_POLICIES = ("idle", "nice", "normal")


@dataclass
class StorageResult:
    """One finished operation. ``sources``: per leading chunk of a lookup, its tier index;
    ``ok``: per chunk of a read, or per chunk of a write (present in at least one tier
    afterwards); ``stored``: per tier, the keys a write put there."""

    op_id: int
    kind: str  # "lookup" | "read" | "write"
    sources: list[int] = field(default_factory=list)
    runs: list[list[int]] = field(default_factory=list)  # lookup_runs: each run's sources
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
        write_batch: int = 4,  # chunks per put() call (one pipeline, one pacing step)
        write_duty: float = 1.0,
        writer_policy: str = "idle",
        write_process: bool = False,
        host: CpuBackend | None = None,
        specs: Sequence[TierSpec] | None = None,
        cached_read_threads: int | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("the storage worker needs at least one tier")
        if writer_policy not in WRITER_POLICIES:
            raise ValueError(
                f"writer_policy must be one of {WRITER_POLICIES}, got {writer_policy!r}"
            )
        if not 0.0 < write_duty <= 1.0:
            raise ValueError(f"write_duty must be in (0, 1], got {write_duty!r}")
        self.tiers = list(tiers)
        self.io_threads = io_threads
        # A staging read from tiers with page-cache reads starts with this many I/O threads
        # and takes all io_threads once a read waits on the device.
        if cached_read_threads is None:
            cores = usable_cores()
            cached_read_threads = max(
                min(MIN_CACHED_READ_THREADS, cores), cores // CORES_PER_CACHED_READ_THREAD
            )
        self.cached_read_threads = max(1, min(io_threads, cached_read_threads))
        self.max_pending_writes = max_pending_writes
        self.write_batch = max(1, write_batch)
        self.write_duty = write_duty
        self._policy = writer_policy
        self._policy_at_start = writer_policy  # the writer threads' initializer's
        self._thread_policy = threading.local()  # the policy a writer thread runs under
        # One header (one hash of the payload) per chunk serves every tier of the same codec.
        codecs = {t.codec for t in self.tiers}
        self._codec = codecs.pop() if len(codecs) == 1 else None
        self._reads = ThreadPoolExecutor(io_threads, thread_name_prefix="kv-storage-io")
        # Writes run at the lowest CPU priority: on a CPU engine they would otherwise take
        # cores from the forward pass (hashing, copies, syscalls); nobody waits for them.
        self._writes = ThreadPoolExecutor(
            write_threads,
            thread_name_prefix="kv-storage-write",
            initializer=lower_thread_priority,
            initargs=(writer_policy,),
        )
        self._cond = threading.Condition()
        self._results: list[StorageResult] = []
        self._inflight = 0
        self._pending_write_chunks = 0
        self._ids = itertools.count(1)
        self._closed = False
        # Write pacing: writers start a chunk only while the gate is open and not before
        # _write_at (the duty cycle's next start).
        self._gate = threading.Event()
        self._gate.set()
        self._pace = threading.Lock()
        self._write_at = 0.0
        # The writer process (write_process): its operations in flight, op -> (keys, each
        # tier's targets, start time), and the chunks dropped since it died.
        self.writer: WriterProcess | None = None
        self._host = host
        self._remote: dict[int, tuple[list[bytes], list[list[int | None]], float]] = {}
        self.writer_lost_chunks = 0
        if write_process:
            if host is None or host.shm_fd is None or specs is None or self._codec is None:
                raise ValueError(
                    "a writer process needs the host tier in shared memory, the tier specs "
                    "and one chunk codec for every tier"
                )
            writers = []
            for spec, tier in zip(specs, self.tiers, strict=True):
                options, fds = tier.writer_spec(dict(spec.options))
                writers.append(TierWriterSpec(spec.type, options, fds))
            self.writer = WriterProcess(
                self._codec,
                writers,
                host.shm_fd,
                host.nbytes,
                self._remote_done,
                write_threads=write_threads,
                write_batch=self.write_batch,
                write_duty=write_duty,
                writer_policy=writer_policy,
            )

    # -- submission (engine thread) ------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Start a lookup of ``keys`` (in prefix order); returns its op id."""
        op = next(self._ids)
        self._start(self._reads, op, "lookup", lambda: self._lookup(op, list(keys)))
        return op

    def lookup_runs(self, runs: Sequence[Sequence[bytes]]) -> int:
        """Start lookups of several runs of keys (each in prefix order; KV cache groups) as one
        operation, whose result's ``runs`` holds each run's sources; returns its op id."""
        op = next(self._ids)
        lists = [list(keys) for keys in runs]

        def run() -> StorageResult:
            return StorageResult(op, "lookup", runs=[self._lookup(op, k).sources for k in lists])

        self._start(self._reads, op, "lookup", run)
        return op

    def lookup_now(self, keys: Sequence[bytes]) -> list[int]:
        """The same as :meth:`lookup`, in the calling thread (tiers that look up in memory)."""
        return self._lookup(0, list(keys)).sources

    def read(self, items: Sequence[ReadItem]) -> int:
        """Start reading ``items`` into their destinations; returns its op id. Each tier's
        chunks are cut into groups of contiguous chunks (:func:`read_groups`); one task per
        I/O thread takes the next group until none is left, one ``get`` call per group (a
        thread the machine delays holds back one group, not a fixed share). The result is
        published when the last group ends."""
        op = next(self._ids)
        items = list(items)
        by_tier: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            by_tier.setdefault(item.tier, []).append(i)
        groups = deque(g for idx in by_tier.values() for g in read_groups(idx, self.io_threads))
        ok = [False] * len(items)
        runners = min(self.io_threads, len(groups))
        # Tiers that may read from the page cache start with the cached-read runners and
        # spread over the rest once a read waits on the device (spread()).
        cached = all(self.tiers[t].page_cache_reads for t in by_tier)
        started = min(runners, self.cached_read_threads) if cached else runners
        remaining = [started]
        with self._cond:
            if self._closed:
                raise RuntimeError("storage worker is shut down")
            self._inflight += 1
        t0 = time.perf_counter()

        def spread() -> None:
            nonlocal started
            with self._cond:
                more, started = runners - started, runners
                remaining[0] += more  # the calling runner has not ended: never 0 here
            for _ in range(more):
                self._reads.submit(run)

        def run() -> None:
            while True:
                try:
                    group = groups.popleft()  # atomic: the runners share the groups
                except IndexError:
                    break
                try:
                    tier = self.tiers[items[group[0]].tier]
                    keys = [items[i].key for i in group]
                    outs = [items[i].dest for i in group]
                    if tier.page_cache_reads:
                        got = tier.get(keys, outs, on_wait=spread if started < runners else None)
                    else:
                        got = tier.get(keys, outs)
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

        if not runners:
            with self._cond:
                self._inflight -= 1
                self._results.append(StorageResult(op, "read"))
                self._cond.notify_all()
        for _ in range(started):
            self._reads.submit(run)
        return op

    def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> int | None:
        """Start writing chunks to every tier; None (dropped, counted by each tier) when the
        write queue is full. The payloads must stay valid until the result is polled."""
        n = len(keys)
        writer = self.writer
        with self._cond:
            lost = writer is not None and not writer.alive
            if lost or self._closed or self._pending_write_chunks + n > self.max_pending_writes:
                if lost:
                    self.writer_lost_chunks += n
                for tier in self.tiers:
                    tier.count(dropped=n)
                return None
            self._pending_write_chunks += n
        op = next(self._ids)
        keys, payloads = list(keys), list(payloads)
        if writer is not None:
            self._write_remote(writer, op, keys, payloads)
        else:
            self._start(self._writes, op, "write", lambda: self._write(op, keys, payloads), n)
        return op

    def _write_remote(
        self, writer: WriterProcess, op: int, keys: list[bytes], payloads: list[memoryview]
    ) -> None:
        """Hand a write to the writer process: each tier's targets chosen here, the chunks'
        offsets in the shared host memory sent; :meth:`_remote_done` publishes the answer."""
        assert self._host is not None
        try:
            offsets = [self._host.offset_of(p) for p in payloads]
        except ValueError:  # not host-tier memory: the caller's bug, the queue stays right
            with self._cond:
                self._pending_write_chunks -= len(keys)
            raise
        targets = [tier.begin_put(keys) for tier in self.tiers]
        with self._cond:
            self._inflight += 1
            self._remote[op] = (keys, targets, time.perf_counter())
        if not writer.submit(op, keys, offsets, targets):
            self._remote_done(op, None)

    def _remote_done(self, op: int, reply: dict[str, Any] | None) -> None:
        """The writer process answered ``op`` (None: it died first, nothing is known written):
        each tier publishes its part; the result is queued for :meth:`poll`."""
        with self._cond:
            entry = self._remote.pop(op, None)
        if entry is None:
            return
        keys, targets, t0 = entry
        n = len(keys)
        present = [False] * n
        stored: dict[int, list[bytes]] = {}
        for t, tier in enumerate(self.tiers):
            ok = [bool(g) for g in reply["ok"][t]] if reply else [False] * n
            try:
                held = tier.end_put(keys, targets[t], ok, reply["stats"][t] if reply else {})
            except Exception:  # a tier bug: these chunks count as not written there
                logger.exception("KV storage write %d: tier %s failed to publish", op, t)
                held = [False] * n
            stored[t] = [k for k, h in zip(keys, held, strict=True) if h]
            present = [p or h for p, h in zip(present, held, strict=True)]
        nbytes = self.tiers[0].codec.payload_bytes * n
        result = StorageResult(
            op, "write", ok=present, stored=stored, nbytes=nbytes, seconds=time.perf_counter() - t0
        )
        with self._cond:
            self._inflight -= 1
            self._pending_write_chunks -= n
            self._results.append(result)
            self._cond.notify_all()

    def _start(
        self,
        pool: ThreadPoolExecutor,
        op: int,
        kind: str,
        fn: Callable[[], StorageResult],
        write_chunks: int = 0,
    ) -> None:
        """Run ``fn`` on ``pool``; its result (or, when it raises, an empty one: all misses)
        is queued for :meth:`poll`. ``write_chunks`` leave the pending-write count either way."""
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
                self._pending_write_chunks -= write_chunks
                self._results.append(result)
                self._cond.notify_all()

        pool.submit(run)

    # -- write pacing (any thread) ----------------------------------------------------------
    def pause_writes(self) -> None:
        """Hold writers before their next chunk (the engine is about to compute a step: on a
        CPU engine a writer taking a core stalls the forward's threads)."""
        self._gate.clear()
        if self.writer is not None:
            self.writer.pause()

    def resume_writes(self) -> None:
        """Let writers run again (the step's compute ended)."""
        self._gate.set()
        if self.writer is not None:
            self.writer.resume()

    def configure_writes(
        self,
        *,
        duty: float | None = None,
        policy: str | None = None,
        fs_o_direct: bool | None = None,
    ) -> None:
        """Change the writers' duty cycle or scheduling policy while running, or whether fs
        tiers write with O_DIRECT where they can (benchmarks); thread writers take a new
        policy in their next write."""
        if fs_o_direct is not None:
            for tier in self.tiers:
                if hasattr(tier, "use_o_direct"):
                    tier.use_o_direct(fs_o_direct)
        if duty is not None:
            if not 0.0 < duty <= 1.0:
                raise ValueError(f"write_duty must be in (0, 1], got {duty!r}")
            self.write_duty = duty
        if policy is not None and policy not in WRITER_POLICIES:
            raise ValueError(f"writer_policy must be one of {WRITER_POLICIES}, got {policy!r}")
        if policy is not None:
            self._policy = policy
        if self.writer is not None:
            self.writer.configure(duty=duty, policy=policy, fs_o_direct=fs_o_direct)

    def _paced(self) -> None:
        """Wait for the gate and the duty cycle before writing a chunk (writer threads)."""
        self._gate.wait(PAUSE_BOUND_S)
        if self.write_duty < 1.0:
            with self._pace:
                wait = self._write_at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)

    def _spent(self, seconds: float) -> None:
        """A writer spent ``seconds`` on a chunk: the duty cycle's idle time follows."""
        if self.write_duty < 1.0:
            with self._pace:
                now = time.perf_counter()
                self._write_at = max(self._write_at, now) + seconds * (1 / self.write_duty - 1)

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
        """Stop taking work, let running operations end (their results are discarded); the
        writer process exits (killed if it does not)."""
        with self._cond:
            self._closed = True
        self._reads.shutdown(wait=True, cancel_futures=True)
        self._writes.shutdown(wait=True, cancel_futures=True)
        if self.writer is not None:
            self.writer.close()
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
        policy = self._policy
        if getattr(self._thread_policy, "name", self._policy_at_start) != policy:  # changed
            set_thread_policy(threading.get_native_id(), policy)
        self._thread_policy.name = policy
        n = len(keys)
        present = [False] * n
        stored: dict[int, list[bytes]] = {t: [] for t in range(len(self.tiers))}
        for lo in range(0, n, self.write_batch):
            hi = min(n, lo + self.write_batch)
            self._paced()
            t0 = time.perf_counter()
            codec = self._codec
            headers = None if codec is None else [
                codec.header(keys[i], payloads[i]) for i in range(lo, hi)
            ]  # fmt: skip
            for t, tier in enumerate(self.tiers):
                if t:
                    self._gate.wait(PAUSE_BOUND_S)  # paused meanwhile: the next tier waits
                res = tier.put(keys[lo:hi], payloads[lo:hi], headers)
                for i, r in zip(range(lo, hi), res, strict=True):
                    if r:
                        stored[t].append(keys[i])
                        present[i] = True
            self._spent(time.perf_counter() - t0)
        nbytes = sum(len(p) for p in payloads)
        return StorageResult(op, "write", ok=present, stored=stored, nbytes=nbytes)


def read_groups(items: list[int], threads: int) -> list[list[int]]:
    """``items`` cut into contiguous groups: about ``READ_GROUPS_PER_THREAD`` per thread (a
    late thread's share is small), at most ``MAX_READ_GROUP`` chunks each (one pipeline or a
    run of reads per ``get`` call)."""
    size = min(MAX_READ_GROUP, max(1, -(-len(items) // (threads * READ_GROUPS_PER_THREAD))))
    return [items[i : i + size] for i in range(0, len(items), size)]
