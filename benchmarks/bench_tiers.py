"""Storage tiers below host memory (disk, shared fs, Redis/Valkey): TTFT, sharing, bandwidth,
decode under a store stream, throughput vs hit rate with a working set 4x host memory.

Five measurements (issue 11), each a ratio against a baseline measured in the same run:
1. TTFT of a long prompt (4000 tokens, ``small``) served from each tier / recomputed. One
   engine with the hierarchy host -> disk -> fs -> redis; per prompt: recompute it (stored in
   the host tier and cascaded to every tier), then serve it from disk, then (its chunks removed
   from disk) from fs, then (removed from fs) from redis, the primary prefix cache and the host
   tier emptied before each. Goals: disk >= 5x, fs >= 5x, redis on loopback >= 3x.
2. Cross-instance: TTFT on instance B of a prompt that instance A prefilled, through fs and
   then (removed from fs) through redis / TTFT of B recomputing a prompt of the same length.
   A and B are two engines in one process (each its own host tier, storage worker and tier
   clients; the same fs directory and server). Goal >= 3x.
3. Tier read bandwidth (the storage worker's read of one prompt's chunks, as a staging read:
   payload bytes / wall time, verification included) / raw bandwidth of the same medium for
   the same chunks: a plain read of the same slots (disk, O_DIRECT when the tier uses it) or
   files (fs), a plain pipelined GET of the same values from the same server (redis), with the
   tier's concurrency, with its page-cache concurrency (fs) and with one thread, each into
   buffers of its own reused round after round (as the tier's); interleaved rounds (order
   rotating), per round the tier against the fastest raw read, the median over rounds.
   Goal >= 0.7.
4. Decode throughput while the lower tiers absorb a store stream / the same with them
   detached (one engine; its storage worker attached or detached between runs; interleaved
   runs, order alternating, medians): (a) the engine's own stream (a decode batch while long
   prompts prefill, every chunk cascaded); (b) a heavy stream: a decode batch while a feeder
   thread keeps the storage worker's write queue full of unique chunks. Writes in the
   engine's writer process (the default) and, for comparison, in writer threads of the
   engine's process. Goal >= 0.97. 4v: the server's side of such a stream (page faults and
   CPU per stored chunk while it fills, then evicts), by allocator setting.
5. Prefill throughput vs hit rate, working set 4x the host tier (disk tier on / off, one
   engine, the disk tier detached for "off"): a warm-up stores every working-set prompt; each
   measured batch mixes re-used working-set prompts and fresh ones. Plotted to PNG.

Usage: python benchmarks/bench_tiers.py [--preset small] [--quick] [--tier-dir DIR]
Results: benchmarks/results/tiers_<preset>.{md,json,png} (``--quick``: tiers_quick).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvserve import LLM, SamplingParams
from kvserve.bench.machine import describe_machine, machine_markdown
from kvserve.bench.redis_server import RedisServer
from kvserve.kv.offload.storage_worker import ReadItem, StorageWorker, read_groups
from kvserve.model.presets import make_model

RESULTS = Path(__file__).parent / "results"
TIER_ORDER = ("disk", "fs", "redis")
# CPU consumers (CpuAccount keys, by prefix) of measurement 4: the engine's compute (main
# thread, torch's native threads, host-tier copies) and the storage tiers' work (storage worker,
# backends' I/O pools and sweeper, the Valkey server process). The feeder is neither.
ENGINE_CPU = ("thread:MainThread", "thread:native", "thread:kv-offload", "thread:kv-copy")
TIER_CPU = (
    "proc:storage-writer",
    "thread:kv-writer-ack",
    "thread:kv-storage",
    "thread:kv-disk",
    "thread:kv-fs",
    "thread:kvserve-redis",
    "proc:valkey-server",
)
# Runs of measurement 1: the tier serving, and whether the page cache held its bytes.
TTFT_RUNS = ("disk", "fs", "fs-cold", "redis")


# ------------------------------------------------------------------------------ helpers
def fs_type(path: Path) -> str:
    """File system type of the mount holding ``path`` (longest mount-point prefix)."""
    path = Path(path).resolve()
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(
                    mnt
                ) > len(best):
                    best, kind = mnt, f"{parts[2]} ({parts[0]} on {mnt})"
    except OSError:
        pass
    return kind


def server_version(binary: str | None) -> str | None:
    if not binary:
        return None
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def prompts_of(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def drive(
    llm: LLM,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    concurrency: int | None = None,
    when_done: tuple[int, Callable[[], None]] | None = None,
) -> tuple[list[Any], list[float], float]:
    """Run requests to completion on the engine, at most ``concurrency`` in flight (a closed-
    loop client; default: all at once): (outputs, seconds until each finished, seconds until
    the connector's storage writes drained too). ``when_done=(k, fn)``: ``fn()`` is called as
    soon as the first ``k`` requests have finished."""
    eng = llm.engine
    todo = list(zip(prompts, params, strict=True))
    limit = concurrency or len(todo)
    t0 = time.perf_counter()
    ids: list[str] = []
    done: dict[str, Any] = {}
    t_done: dict[str, float] = {}
    while True:
        while todo and len(ids) - len(done) < limit:
            p, sp = todo.pop(0)
            ids.append(eng.add_request(None, p, sp))
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
                t_done[out.request_id] = time.perf_counter() - t0
                k = when_done[0] if when_done else 0
                if when_done and len(ids) >= k and all(i in done for i in ids[:k]):
                    when_done[1]()
                    when_done = None
    return [done[i] for i in ids], [t_done[i] for i in ids], time.perf_counter() - t0


def generate1(llm: LLM, prompt: list[int]) -> Any:
    (out,), _, _ = drive(llm, [prompt], [SamplingParams(max_tokens=1, temperature=0.0)])
    return out


def forget_above_storage(llm: LLM) -> None:
    """Empty the primary prefix cache and the host tier (engine idle): the next request finds
    its prefix only in the storage tiers."""
    assert not llm.engine.has_unfinished_requests()
    assert llm.reset_prefix_cache()
    llm.engine.connector.manager.clear()


def host_keys(llm: LLM) -> list[bytes]:
    """Chunk keys the host tier holds (in store order)."""
    return list(llm.engine.connector.manager._entries)


def tier_by_name(llm: LLM, name: str):
    conn = llm.engine.connector
    tiers = conn.tiers if conn.tiers else []
    return next(t for t in tiers if t.name == name)


def tier_counts(llm: LLM) -> dict[str, dict[str, float]]:
    """Per tier name (disk/fs/redis): the tier's counters."""
    return {t.name: t.stats.as_dict() for t in llm.engine.connector.tiers}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


class ReadOps:
    """Records the storage worker's finished read operations (staging of tier hits into host
    slots): payload bytes and wall seconds from submission to the last chunk verified."""

    def __init__(self, llm: LLM) -> None:
        self.ops: list[tuple[int, float]] = []
        conn = llm.engine.connector
        orig = conn._storage_done

        def wrapped(res, out):
            if res.kind == "read":
                self.ops.append((res.nbytes, res.seconds))
            return orig(res, out)

        conn._storage_done = wrapped

    def take(self) -> tuple[int, float]:
        ops, self.ops = self.ops, []
        return sum(b for b, _ in ops), sum(s for _, s in ops)


class ConnectorTimer:
    """Wall time the engine thread spends in the connector's calls (outermost calls only;
    includes sleeping on transfers when a step has nothing to compute)."""

    def __init__(self, connector) -> None:
        self.seconds = 0.0
        self._depth = 0
        for name in dir(type(connector)):
            fn = getattr(connector, name)
            if not name.startswith("_") and callable(fn):
                setattr(connector, name, self._timed(fn))

    def _timed(self, fn):
        def wrapper(*a, **kw):
            if self._depth:
                return fn(*a, **kw)
            self._depth += 1
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
                self._depth -= 1

        return wrapper


class StorageSwitch:
    """Attach or detach an engine's storage tiers between runs (nothing in flight): detached,
    the connector neither cascades stores nor looks below the host tier. Attached, through
    the engine's own storage worker (writes in its writer process) or through a second
    worker on the same tiers whose writes run in writer threads of this process (the
    previous design, for comparison)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        conn = llm.engine.connector
        self.storage = conn.storage
        assert self.storage is not None and self.storage.writer is not None
        self.threaded: StorageWorker | None = None

    def worker(self, mode: str) -> StorageWorker:
        if mode == "proc":
            return self.storage
        if self.threaded is None:
            cfg = self.llm.engine.config
            self.threaded = StorageWorker(
                self.llm.engine.connector.tiers,
                io_threads=cfg.kv_tier_io_threads,
                max_pending_writes=cfg.kv_tier_max_pending_writes,
            )
        return self.threaded

    def set(self, mode: str | None) -> None:
        """``proc``, ``thread`` or None (detached)."""
        eng = self.llm.engine
        assert not eng.has_unfinished_requests() and not eng.connector._write_ops
        eng.connector.storage = None if mode is None else self.worker(mode)

    def close(self) -> None:
        self.set("proc")
        if self.threaded is not None:  # its tiers are the engine's: not closed here
            self.threaded._reads.shutdown(wait=True)
            self.threaded._writes.shutdown(wait=True)


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_faults_cpu(pid: int | str) -> tuple[int, float]:
    """(minor page faults, CPU seconds) of process ``pid`` so far (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]), (int(fields[11]) + int(fields[12])) / _CLK_TCK


class CpuAccount:
    """CPU seconds by consumer between two snapshots: this process's threads grouped by name
    (the main thread runs the engine; ``native`` = threads unknown to Python: torch's OpenMP
    team), other processes we know (the Valkey server), and the whole machine (kernel
    writeback included)."""

    def __init__(self, pids: dict[str, int] | None = None) -> None:
        self.pids = pids or {}

    @staticmethod
    def _proc_cpu(pid: int | str) -> float:
        try:
            return proc_faults_cpu(pid)[1]
        except (OSError, IndexError, ValueError):
            return 0.0

    @staticmethod
    def _machine_busy() -> tuple[float, float]:
        """(busy, steal) CPU seconds of the whole machine: steal is time the hypervisor ran
        something else on our vCPUs (its own I/O or memory work for us, other guests); with
        paravirtual time accounting a thread's CPU time leaves it out, wall time does not."""
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        steal = vals[7] if len(vals) > 7 else 0
        return (sum(vals[:8]) - idle) / _CLK_TCK, steal / _CLK_TCK

    def snapshot(self) -> dict[str, float]:
        snap: dict[str, float] = {}
        named = 0.0
        for t in threading.enumerate():
            try:
                with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                    s = int(f.read().split()[0]) / 1e9
            except (OSError, TypeError):
                continue
            group = t.name.rsplit("_", 1)[0] if t.name[-1:].isdigit() else t.name
            snap[f"thread:{group}"] = snap.get(f"thread:{group}", 0.0) + s
            named += s
        total = self._proc_cpu("self")
        snap["thread:native"] = max(0.0, total - named)
        snap["process"] = total
        for name, pid in self.pids.items():
            snap[f"proc:{name}"] = self._proc_cpu(pid)
        snap["machine"], snap["steal"] = self._machine_busy()
        return snap

    @staticmethod
    def diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: round(b[k] - a.get(k, 0.0), 3) for k in b}


def per_second(ds: list[dict[str, float]], secs: list[float]) -> dict[str, float]:
    """Sums of ``ds`` (CPU seconds by consumer) over the sum of ``secs`` (wall seconds)."""
    keys = sorted({k for d in ds for k in d})
    total = sum(secs) or 1.0
    return {k: round(sum(d.get(k, 0.0) for d in ds) / total, 4) for k in keys}


def median_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in ds for k in d})
    return {k: round(statistics.median(d.get(k, 0.0) for d in ds), 3) for k in keys}


# ------------------------------------------------------------------------------ raw reads
def drop_fs_cache(tier, keys: list[bytes]) -> None:
    """Write back and drop the page cache of the fs tier's files of ``keys``: the next read
    goes to the device (as on another node, or long after the write)."""
    for k in keys:
        fd = os.open(tier.path_of(k), os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_fs_cache(tier, keys: list[bytes]) -> None:
    """Read the fs tier's files of ``keys`` once, so that the page cache holds them (the
    tier writes with O_DIRECT where it can: a chunk is cached on a node once a reader there
    read it, not when it was written)."""
    buf = bytearray(1 << 20)
    for k in keys:
        with open(tier.path_of(k), "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _destination(n: int) -> mmap.mmap:
    """``n`` bytes of page-aligned memory (usable for O_DIRECT), faulted in, as host-tier
    slots are: each chunk read lands in memory of its own, like the tier's staging."""
    buf = mmap.mmap(-1, n)
    for off in range(0, n, mmap.PAGESIZE):
        buf[off] = 0
    return buf


def _recv_exact(sock: socket.socket, dest: memoryview) -> None:
    pos = 0
    while pos < len(dest):
        got = sock.recv_into(dest[pos:], len(dest) - pos, socket.MSG_WAITALL)
        if not got:
            raise ConnectionError("server closed the connection")
        pos += got


def raw_slot_bytes(tier) -> int:
    """Bytes a plain read of one chunk of ``tier`` lands (a disk slot, a whole file or value)."""
    return tier.slot_bytes if tier.name == "disk" else tier.codec.stored_bytes


def raw_read(
    tier,
    keys: list[bytes],
    threads: int,
    batch: int,
    dest: memoryview,
    client: str = "socket",
) -> float:
    """Bytes/s of a plain read of the chunks ``keys`` of ``tier`` from the same medium (counted
    as payload bytes, as the tier counts them) into ``dest`` (:func:`raw_slot_bytes` per
    chunk: memory of this kind of read's own, reused round after round as the tier's staging
    buffers are; fresh pages would start cache-hot, just zeroed by the kernel): ``threads``
    readers taking chunks in order (disk, fs) or ``batch`` chunks per request (redis: one
    pipeline; ``client="socket"``: GETs written to a plain socket, each value received
    straight into its destination; ``"redis-py"``: a redis-py pipeline)."""
    from kvserve.kv.backends.disk import preadv_all

    n = len(keys)
    payload = tier.codec.payload_bytes
    close: Callable[[], None] = lambda: None  # noqa: E731
    if tier.name == "disk":
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if tier.o_direct else 0)
        fd = os.open(tier.path, flags)
        close = lambda: os.close(fd)  # noqa: E731
        with tier._cond:
            slots = [tier._index[k] for k in keys]
        size = tier.slot_bytes

        def one(idx: list[int]) -> None:
            for i in idx:
                off = slots[i] * size
                assert preadv_all(fd, [dest[i * size : (i + 1) * size]], off)
                if not tier.o_direct:  # as the tier does: the next read goes to the device
                    os.posix_fadvise(fd, off, size, os.POSIX_FADV_DONTNEED)

    elif tier.name == "fs":
        paths = [tier.path_of(k) for k in keys]
        size = tier.codec.stored_bytes

        def one(idx: list[int]) -> None:
            for i in idx:
                fd = os.open(paths[i], os.O_RDONLY | os.O_CLOEXEC)
                try:
                    assert preadv_all(fd, [dest[i * size : (i + 1) * size]], 0)
                finally:
                    os.close(fd)

    elif tier.name == "redis" and client == "redis-py":
        import redis

        pool = redis.ConnectionPool.from_url(
            tier.url, max_connections=threads, socket_read_size=1 << 20
        )
        rc = redis.Redis(connection_pool=pool)
        conns = [pool.get_connection() for _ in range(threads)]  # connected before timing
        for c in conns:
            pool.release(c)
        close = pool.disconnect
        skeys = [tier.server_key(k) for k in keys]

        def one(idx: list[int]) -> None:
            pipe = rc.pipeline(transaction=False)
            for i in idx:
                pipe.get(skeys[i])
            assert all(v is not None for v in pipe.execute())

    elif tier.name == "redis":
        from urllib.parse import urlsplit

        u = urlsplit(tier.url)
        socks = [socket.create_connection((u.hostname, u.port or 6379)) for _ in range(threads)]
        close = lambda: [x.close() for x in socks]  # noqa: E731
        free = list(socks)
        lock = threading.Lock()
        size = tier.codec.stored_bytes
        want = b"$%d\r\n" % size
        skeys = [tier.server_key(k) for k in keys]

        def one(idx: list[int]) -> None:
            with lock:
                sock = free.pop()
            try:
                sock.sendall(
                    b"".join(
                        b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(skeys[i]), skeys[i]) for i in idx
                    )  # fmt: skip
                )
                head = memoryview(bytearray(len(want)))
                crlf = memoryview(bytearray(2))
                for i in idx:
                    _recv_exact(sock, head)
                    assert head == want, bytes(head)
                    _recv_exact(sock, dest[i * size : (i + 1) * size])
                    _recv_exact(sock, crlf)
            finally:
                with lock:
                    free.append(sock)

    else:
        raise ValueError(tier.name)
    if tier.name != "redis":
        batch = 1  # one chunk per task, as the disk and fs tiers spread a call's chunks
    work = [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]
    ex = ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        if ex is not None:  # threads started outside the timing (the tier's pools run)
            barrier = threading.Barrier(threads)
            list(ex.map(lambda _: barrier.wait(), range(threads)))
        t = time.perf_counter()
        if ex is not None:
            list(ex.map(one, work))
        else:
            for w in work:
                one(w)
        dt = time.perf_counter() - t
    finally:
        if ex is not None:
            ex.shutdown()
        close()
    return n * payload / dt


# ------------------------------------------------------------------------------ setup
class Setup:
    """The model, the tier directories and the Valkey server shared by all measurements."""

    def __init__(self, args) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="kvserve-bench-tiers-model-"))
        if args.model:
            self.model = args.model
        else:
            self.model = str(make_model(self.tmp / args.preset, preset=args.preset))
        base = Path(args.tier_dir) if args.tier_dir else Path("/var/tmp")
        base.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-tiers-", dir=base))
        self.redis = RedisServer(
            maxmemory=args.redis_maxmemory, reuse_freed_memory=not args.redis_malloc_defaults
        )
        self.redis.start()
        probe = LLM(model=self.model, num_kv_blocks=8)
        self.vocab = probe.get_tokenizer().vocab_size
        kv = probe.engine.kv_cache
        self.block_size = probe.engine.config.block_size
        self.kv_bytes_per_token = kv[0].numel() * kv.element_size() // self.block_size
        probe.shutdown()
        self._n = 0

    def subdir(self, name: str) -> Path:
        self._n += 1
        p = self.dir / f"{self._n:02d}-{name}"
        p.mkdir()
        return p

    def flush_redis(self) -> None:
        self.redis.client().flushall()

    def tier_specs(self, names: Sequence[str], root: Path, size: int) -> list[str]:
        specs = []
        for name in names:
            if name == "disk":
                specs.append(f"disk:path={root / 'disk'},size={size}B")
            elif name == "fs":
                specs.append(f"fs:path={root / 'fs'},size={size}B")
            elif name == "redis":
                specs.append(f"redis:url={self.redis.url}")
            specs[-1] += "".join(f",{o}" for o in self.args.tier_option.get(name, []))
        return specs

    def llm(self, tiers: list[str], offload_bytes: int, **kw) -> LLM:
        a = self.args
        kw.setdefault("num_kv_blocks", a.num_kv_blocks)
        kw.setdefault("max_num_seqs", a.max_num_seqs)
        kw.setdefault("max_num_batched_tokens", a.max_num_batched_tokens)
        return LLM(
            model=self.model,
            kv_offload_size=offload_bytes / (1 << 30),
            kv_offload_block_size=a.chunk_tokens,
            kv_tier=tiers,
            **kw,
        )

    def close(self) -> None:
        self.redis.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


# ------------------------------------------------------------------------------ 1 + 3
def bench_ttft_tiers(st: Setup, args, progress) -> dict:
    """Measurement 1 (TTFT per tier vs recompute) and 3 (tier read bandwidth vs raw)."""
    length = args.ttft_len
    prompt_bytes = length * st.kv_bytes_per_token
    root = st.subdir("ttft")
    st.flush_redis()
    size = 4 * args.reps * prompt_bytes + (64 << 20)
    llm = st.llm(st.tier_specs(TIER_ORDER, root, size), 2 * prompt_bytes + (16 << 20))
    reads = ReadOps(llm)
    rng = random.Random(3)
    min_hit = length - args.chunk_tokens - 1
    rows: dict[str, dict[str, list]] = {t: {"ttft_s": [], "read_GB_s": []} for t in TTFT_RUNS}
    cold: list[float] = []
    host: list[float] = []
    generate1(llm, prompts_of(rng, 1, 256, st.vocab)[0])  # warm up
    for _rep in range(args.reps):
        p = prompts_of(rng, 1, length, st.vocab)[0]
        forget_above_storage(llm)
        before = tier_counts(llm)
        out = generate1(llm, p)  # recomputed; stored in host memory and cascaded to every tier
        cold.append(out.metrics.time_to_first_token)
        keys = host_keys(llm)
        written = {t: delta(v, before[t])["written"] for t, v in tier_counts(llm).items()}
        assert all(w >= len(keys) for w in written.values()), written
        progress(f"recompute {length} tokens: {cold[-1] * 1e3:.0f} ms ({len(keys)} chunks)")
        # Reference: the same prompt from the host tier (what a storage hit adds to).
        assert llm.reset_prefix_cache()
        before = tier_counts(llm)
        out = generate1(llm, p)
        assert out.metrics.num_external_cached_tokens >= min_hit
        assert all(delta(v, before[t])["hits"] == 0 for t, v in tier_counts(llm).items())
        host.append(out.metrics.time_to_first_token)
        for run in TTFT_RUNS:
            name = run.split("-")[0]
            tier = tier_by_name(llm, name)
            if run.endswith("-cold"):
                drop_fs_cache(tier, keys)
            elif name == "fs":
                warm_fs_cache(tier, keys)
            forget_above_storage(llm)
            before = tier_counts(llm)
            reads.take()
            out = generate1(llm, p)
            got = delta(tier_counts(llm)[name], before[name])
            ext = out.metrics.num_external_cached_tokens
            assert ext >= min_hit and got["hits"] == len(keys), (name, ext, got)
            nbytes, secs = reads.take()
            r = rows[run]
            r["ttft_s"].append(out.metrics.time_to_first_token)
            r["read_GB_s"].append(nbytes / secs / 1e9)
            progress(
                f"{run}: TTFT {r['ttft_s'][-1] * 1e3:.0f} ms, staging read "
                f"{r['read_GB_s'][-1]:.2f} GB/s"
            )
            if run != "fs":
                tier.remove(keys)  # the next tier down serves the next run
    disk = tier_by_name(llm, "disk")
    info = {
        "disk_o_direct": disk.o_direct,
        "disk_zero_copy": disk._zero_copy_ok,
        "tier_stats": tier_counts(llm),
    }
    llm.shutdown()
    c = statistics.median(cold)
    res: dict = {
        "prompt_tokens": length,
        "chunks": len(keys),
        "recompute_s": cold,
        "host_tier_s": host,
        **info,
    }
    for name, r in rows.items():
        w = statistics.median(r["ttft_s"])
        res[name] = {
            **r,
            "ttft_median_s": w,
            "speedup": c / w,
            "read_median_GB_s": statistics.median(r["read_GB_s"]),
        }
    return res


# ------------------------------------------------------------------------------ 3
BUSY_STEP_S = 0.002  # 3': the engine thread's Python between two polls of the storage worker


def await_result(storage: StorageWorker, busy: bool = False) -> Any:
    """The next result of ``storage`` (an idle engine's: the read just submitted). ``busy``:
    this thread, the engine's, runs pure Python meanwhile, polling every ``BUSY_STEP_S`` (the
    GIL released only at the switch interval)."""
    while True:
        if busy:  # a step's worth of Python (scheduling, outputs), then a poll
            end = time.perf_counter() + BUSY_STEP_S
            while time.perf_counter() < end:
                pass
        else:
            storage.wait_any(1.0)
        for r in storage.poll():
            return r


def bench_read_ratio(st: Setup, args, progress) -> dict:
    """Measurement 3: the storage worker's read of a prompt's chunks from each tier (what a
    staging read does: groups of contiguous chunks over the I/O threads, each verified) / a
    plain read of the same bytes, in ``read_rounds`` interleaved rounds, the order rotating;
    per round, the tier against the faster raw read of that round."""
    length = args.ttft_len
    prompt_bytes = length * st.kv_bytes_per_token
    root = st.subdir("read")
    st.flush_redis()
    llm = st.llm(
        st.tier_specs(TIER_ORDER, root, 2 * prompt_bytes + (64 << 20)),
        2 * prompt_bytes + (16 << 20),
    )
    rng = random.Random(4)
    generate1(llm, prompts_of(rng, 1, length, st.vocab)[0])  # stored and cascaded (drained)
    keys = host_keys(llm)
    conn = llm.engine.connector
    storage = conn.storage
    io_threads = storage.io_threads
    batch = len(read_groups(list(range(len(keys))), io_threads)[0])
    payload = conn.tier.layout.chunk_bytes
    dest = memoryview(_destination(len(keys) * payload))  # page-aligned, faulted in: as slots
    outs = [dest[i * payload : (i + 1) * payload] for i in range(len(keys))]

    cached_threads = storage.cached_read_threads

    def tier_read(
        t: int, threads: int = cached_threads, python_read: bool = False, busy: bool = False
    ) -> float:
        """The storage worker's read of every chunk from tier ``t`` (``busy``: see
        :func:`await_result`)."""
        storage.cached_read_threads = threads
        native = getattr(conn.tiers[t], "native_read", None)
        if python_read:
            conn.tiers[t].native_read = False
        try:
            op = storage.read([ReadItem(t, k, o) for k, o in zip(keys, outs, strict=True)])
        finally:
            storage.cached_read_threads = cached_threads
            if python_read:
                conn.tiers[t].native_read = native
        r = await_result(storage, busy)  # the engine is idle: this read's is the only one
        assert r.op_id == op and all(r.ok), (r.op_id, op, r.ok)
        return r.nbytes / r.seconds

    res: dict = {
        "chunks": len(keys),
        "io_threads": io_threads,
        "cached_read_threads": cached_threads,
        "read_batch": batch,
    }
    for run in TTFT_RUNS:
        name = run.split("-")[0]
        t = next(i for i, x in enumerate(conn.tiers) if x.name == name)
        tier = conn.tiers[t]
        cold = run.endswith("-cold")
        # Each kind of raw read lands in memory of its own, allocated once: as the tier's.
        raw_kinds = ["raw", "raw_1"]
        if tier.page_cache_reads and cached_threads not in (1, io_threads):
            raw_kinds.append("raw_c")  # the threads the tier itself reads the page cache with
        if name == "redis":
            raw_kinds.append("raw_redis_py")  # a reference: redis-py (its parser copies)
        size = len(keys) * raw_slot_bytes(tier)
        bufs = {k: memoryview(_destination(size)) for k in raw_kinds}
        kinds: dict[str, Callable[[], float]] = {
            "tier": lambda t=t: tier_read(t),
            "raw": lambda tier=tier, b=bufs["raw"]: raw_read(tier, keys, io_threads, batch, b),
            "raw_1": lambda tier=tier, b=bufs["raw_1"]: raw_read(tier, keys, 1, len(keys), b),
        }
        if "raw_c" in bufs:  # and for reference: the tier reading with one thread
            kinds["tier_1"] = lambda t=t: tier_read(t, 1)
            kinds["raw_c"] = lambda tier=tier, b=bufs["raw_c"]: raw_read(
                tier, keys, cached_threads, batch, b
            )
        if getattr(tier, "native_read", False):  # and its read in Python (no C extension)
            kinds["tier_py"] = lambda t=t: tier_read(t, python_read=True)
            if not cold:  # both while the engine's thread runs Python (3')
                kinds["tier_busy"] = lambda t=t: tier_read(t, busy=True)
                kinds["tier_py_busy"] = lambda t=t: tier_read(t, python_read=True, busy=True)
        if "raw_redis_py" in bufs:
            kinds["raw_redis_py"] = lambda tier=tier, b=bufs["raw_redis_py"]: raw_read(
                tier, keys, io_threads, batch, b, client="redis-py"
            )
        order = list(kinds)
        rows: dict[str, list[float]] = {k: [] for k in kinds}
        if name == "fs" and not cold:
            warm_fs_cache(tier, keys)
        for i in range(args.read_rounds):
            for k in order[i % len(order) :] + order[: i % len(order)]:
                if cold:  # every read, the tier's and the raw ones, goes to the device
                    drop_fs_cache(tier, keys)
                rows[k].append(kinds[k]() / 1e9)
        plain = [k for k in rows if k in ("raw", "raw_1", "raw_c")]  # redis-py: a reference
        best = [max(rows[k][i] for k in plain) for i in range(args.read_rounds)]
        ratios = [rows["tier"][i] / b for i, b in enumerate(best)]
        med = {k: statistics.median(v) for k, v in rows.items()}
        res[run] = {
            "GB_s": rows,
            "median_GB_s": med,
            "ratios": ratios,
            **(
                {"ratios_py": [x / b for x, b in zip(rows["tier_py"], best, strict=True)]}
                if "tier_py" in rows
                else {}
            ),
            **(
                {
                    "busy_native_over_py": [
                        x / y for x, y in zip(rows["tier_busy"], rows["tier_py_busy"], strict=True)
                    ]
                }
                if "tier_busy" in rows
                else {}
            ),
            "ratio_median": statistics.median(ratios),
            "ratio_of_medians": med["tier"] / max(med[k] for k in plain),
        }
        progress(
            f"{run}: tier {med['tier']:.2f} GB/s, raw {med['raw']:.2f} / one thread "
            f"{med['raw_1']:.2f}"
            + (f" / {cached_threads} threads {med['raw_c']:.2f}" if "raw_c" in med else "")
            + f"; ratio {res[run]['ratio_median']:.2f} (rounds "
            + ", ".join(f"{x:.2f}" for x in sorted(ratios))
            + ")"
        )
    llm.shutdown()
    return res


# ------------------------------------------------------------------------------ 2
def bench_cross_instance(st: Setup, args, progress) -> dict:
    length = args.ttft_len
    prompt_bytes = length * st.kv_bytes_per_token
    root = st.subdir("shared")
    st.flush_redis()
    size = 4 * args.cross_reps * prompt_bytes + (64 << 20)
    specs = st.tier_specs(("fs", "redis"), root, size)
    host = 2 * prompt_bytes + (16 << 20)
    a = st.llm(specs, host)
    b = st.llm(specs, host)
    rng = random.Random(4)
    min_hit = length - args.chunk_tokens - 1
    recompute, via = [], {"fs": [], "redis": []}
    for llm in (a, b):
        generate1(llm, prompts_of(rng, 1, 256, st.vocab)[0])  # warm up
    for _rep in range(args.cross_reps):
        p, q = prompts_of(rng, 2, length, st.vocab)
        forget_above_storage(a)
        generate1(a, p)  # prefilled on A, cascaded to fs and redis
        keys = host_keys(a)
        forget_above_storage(b)
        recompute.append(generate1(b, q).metrics.time_to_first_token)  # B recomputes
        for name in ("fs", "redis"):
            forget_above_storage(b)
            before = tier_counts(b)
            out = generate1(b, p)
            got = delta(tier_counts(b)[name], before[name])
            ext = out.metrics.num_external_cached_tokens
            assert out.metrics.num_cached_tokens == 0
            assert ext >= min_hit and got["hits"] == len(keys), (name, ext, got)
            via[name].append(out.metrics.time_to_first_token)
            tier_by_name(b, name).remove(keys)  # redis serves the next run
        progress(
            f"B recompute {recompute[-1] * 1e3:.0f} ms; A's prompt on B via fs "
            f"{via['fs'][-1] * 1e3:.0f} ms, via redis {via['redis'][-1] * 1e3:.0f} ms"
        )
    a.shutdown()
    b.shutdown()
    c = statistics.median(recompute)
    res: dict = {"prompt_tokens": length, "recompute_s": recompute, "instances": "one process"}
    for name, ts in via.items():
        res[name] = {"ttft_s": ts, "ttft_median_s": statistics.median(ts)}
        res[name]["speedup"] = c / res[name]["ttft_median_s"]
    return res


# ------------------------------------------------------------------------------ 4
class Feeder:
    """A heavy store stream: unique chunks (random keys, payloads from a few host buffers)
    submitted to the storage worker at ``rate`` bytes/s, as the cascade of a fast prefill
    would (``rate`` 0: whenever its bounded write queue has room, as fast as the tiers
    absorb). ``active``: submit only while it is set (the stream toggled on and off; each
    time it resumes at ``rate``, no catching up)."""

    def __init__(
        self,
        storage,
        host,
        rate: float = 0.0,
        batch: int = 8,
        active: threading.Event | None = None,
    ) -> None:
        self.storage = storage
        self.batch = batch
        self.active = active
        payload_bytes = host.layout.chunk_bytes
        self.interval = batch * payload_bytes / rate if rate > 0 else 0.0
        # Payloads in host-tier slots (a writer process reads them there, as the cascade's):
        # the last ones of the tier, whatever they hold at the time.
        n = min(4 * batch, host.num_slots)
        self.views = [memoryview(host.slots_u8[host.num_slots - 1 - i].numpy()) for i in range(n)]
        self.chunks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-feeder", daemon=True)

    def _run(self) -> None:
        s = self.storage
        i = 0
        room = lambda: s._pending_write_chunks + self.batch <= s.max_pending_writes  # noqa: E731
        due = time.perf_counter()
        while not self._stop.is_set():
            if self.active is not None and not self.active.is_set():
                self.active.wait(0.05)
                due = time.perf_counter()
                continue
            if self.interval:
                due += self.interval
                if self._stop.wait(max(0.0, due - time.perf_counter())):
                    break
            else:
                with s._cond:  # notified as each write ends: no polling (no GIL traffic)
                    if not s._cond.wait_for(room, timeout=0.1):
                        continue
            if self.active is not None and not self.active.is_set():
                continue  # toggled off meanwhile
            views = [self.views[(i + j) % len(self.views)] for j in range(self.batch)]
            if s.write([os.urandom(32) for _ in views], views) is not None:
                self.chunks += self.batch
            i += self.batch

    def __enter__(self) -> Feeder:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        s = self.storage
        with s._cond:  # the queued chunks are written before the next run starts
            s._cond.wait_for(lambda: not s._inflight, timeout=120)


def set_process_policy(pid: int, policy: int) -> None:
    """Every thread of process ``pid`` to scheduling ``policy`` (priority 0)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))


class WriterVariant:
    """How the storage writes run in one "on" run of measurement 4: ``+``-joined settings,
    ``proc`` / ``thread`` (in the engine's writer process, the default, or in writer threads
    of the engine's process, the previous design), ``idle`` / ``nice`` / ``normal`` (the
    writers' scheduling: ``SCHED_IDLE``, the default, nice 19, or as the engine's threads),
    ``gap`` (writes paused while the engine computes a step, resumed between steps:
    ``kv_tier_write_pause``), ``duty=F`` (writers held to a duty cycle F,
    ``kv_tier_write_duty``), ``srvidle`` (the local Valkey server's threads under
    ``SCHED_IDLE`` too: a deployment choice for a server sharing the engine's cores),
    ``fsbuf`` / ``fsdirect`` (the fs tier's writes buffered / with O_DIRECT where the file
    system takes it, whatever its ``o_direct`` option: ``use_o_direct``)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.mode, self.policy, self.gap, self.duty, self.server_idle = (
            "proc", "idle", False, 1.0, False,
        )  # fmt: skip
        self.fs_o_direct: bool | None = None  # None: as the fs tier's option says
        for part in spec.split("+"):
            if part in ("proc", "thread"):
                self.mode = part
            elif part in ("idle", "nice", "normal"):
                self.policy = part
            elif part == "gap":
                self.gap = True
            elif part == "srvidle":
                self.server_idle = True
            elif part in ("fsbuf", "fsdirect"):
                self.fs_o_direct = part == "fsdirect"
            elif part.startswith("duty="):
                self.duty = float(part[5:])
            else:
                raise ValueError(f"writer variant {spec!r}: unknown {part!r}")

    def apply(self, llm: LLM, switch: StorageSwitch, server_pid: int) -> Callable[[], None]:
        """Attach the tiers this way (the engine idle); returns the undo."""
        switch.set(self.mode)
        return self.configure(llm, switch.worker(self.mode), server_pid)

    def configure(self, llm: LLM, storage: StorageWorker, server_pid: int) -> Callable[[], None]:
        """Set the writers of ``storage`` this way (also between two steps of a running
        engine: the writer process takes it before its next batch); returns the undo."""
        fs = [t for t in llm.engine.connector.tiers if t.name == "fs"]
        configured = fs[0].o_direct if fs else None
        storage.configure_writes(duty=self.duty, policy=self.policy, fs_o_direct=self.fs_o_direct)
        runner = llm.engine.runner
        execute = runner.execute_model

        def execute_paused(*a, **kw):
            storage.pause_writes()
            try:
                return execute(*a, **kw)
            finally:
                storage.resume_writes()

        if self.gap:
            runner.execute_model = execute_paused
        if self.server_idle:
            set_process_policy(server_pid, os.SCHED_IDLE)

        def undo() -> None:
            runner.execute_model = execute
            storage.resume_writes()
            restore = None if self.fs_o_direct is None else configured
            storage.configure_writes(duty=1.0, policy="idle", fs_o_direct=restore)
            if self.server_idle:
                set_process_policy(server_pid, os.SCHED_OTHER)

        return undo


def bench_decode(st: Setup, args, progress) -> dict:
    root = st.subdir("decode")
    st.flush_redis()
    chunk_bytes = args.chunk_tokens * st.kv_bytes_per_token
    size = args.decode_tier_bytes
    llm = st.llm(
        st.tier_specs(args.decode_tiers, root, size),
        max(64 * chunk_bytes, 4 * args.decode_prefill_len * st.kv_bytes_per_token),
        max_num_batched_tokens=args.decode_batched_tokens,
        max_num_seqs=args.decode_batch + args.decode_prefills,
        num_threads=args.decode_threads,
    )
    switch = StorageSwitch(llm)
    timer = ConnectorTimer(llm.engine.connector)
    acct = CpuAccount(
        {"valkey-server": st.redis.proc.pid, "storage-writer": switch.storage.writer.pid}
    )
    rng = random.Random(5)
    dec_sp = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    pre_sp = SamplingParams(max_tokens=1, temperature=0.0)
    n_dec = args.decode_batch
    variants = [WriterVariant(v) for v in args.decode_variants]

    def run(kind: str, variant: WriterVariant | None) -> dict:
        on = variant is not None
        prompts = prompts_of(rng, n_dec, args.decode_prompt_len, st.vocab)
        params = [dec_sp] * n_dec
        if kind == "own":
            prompts += prompts_of(rng, args.decode_prefills, args.decode_prefill_len, st.vocab)
            params += [pre_sp] * args.decode_prefills
        switch.set(None)
        undo = variant.apply(llm, switch, st.redis.proc.pid) if variant else lambda: None
        before_t = tier_counts(llm) if on else {}
        s0 = acct.snapshot()
        c0 = timer.seconds
        end: dict = {}

        def at_end() -> None:  # the decode batch finished: the window measured ends here
            end.update(cpu=acct.snapshot(), conn=timer.seconds, tiers=tier_counts(llm))

        try:
            if kind == "heavy" and variant is not None:
                storage = switch.worker(variant.mode)
                with Feeder(storage, llm.engine.connector.tier, args.heavy_mb_s * 1e6) as f:
                    _, t_done, drained = drive(llm, prompts, params, when_done=(n_dec, at_end))
                fed = f.chunks
            else:
                _, t_done, drained = drive(llm, prompts, params, when_done=(n_dec, at_end))
                fed = 0
        finally:
            undo()
        cpu = CpuAccount.diff(s0, end["cpu"])
        after_t = end["tiers"]
        t = max(t_done[:n_dec])
        row = {"decode_tok_s": n_dec * args.decode_tokens / t, "seconds": t, "cpu": cpu}
        row["engine_thread_connector_s"] = end["conn"] - c0
        engine_cpu = sum(v for k, v in cpu.items() if k.startswith(ENGINE_CPU))
        tier_cpu = sum(v for k, v in cpu.items() if k.startswith(TIER_CPU))
        row["engine_cpu_s"], row["tier_cpu_s"] = engine_cpu, tier_cpu
        # Every CPU second the tiers take on a machine the engine keeps busy is one the
        # forward does not get (GIL waits not counted).
        row["accounted_ratio"] = engine_cpu / (engine_cpu + tier_cpu)
        if on:
            d = {k: delta(v, before_t[k]) for k, v in after_t.items()}
            row["tiers"] = {
                k: {f: v[f] for f in ("written", "write_bytes", "dropped", "errors")}
                for k, v in d.items()
            }
            row["written_MB_s"] = {k: v["write_bytes"] / t / 1e6 for k, v in d.items()}
            written = sum(v["write_bytes"] for v in d.values())
            row["tier_cpu_s_per_GB"] = tier_cpu / (written / 1e9) if written else None
            row["fed_chunks"] = fed
            row["written_after_drain"] = {
                k: delta(v, before_t[k])["written"] for k, v in tier_counts(llm).items()
            }
            row["drain_s"] = drained - t
        switch.set("proc")
        return row

    def summary(on_rows: list[dict], off_rows: list[dict]) -> dict:
        thr_on = statistics.median(r["decode_tok_s"] for r in on_rows)
        thr_off = statistics.median(r["decode_tok_s"] for r in off_rows)
        pairs = sorted(
            a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(on_rows, off_rows, strict=True)
        )
        return {
            "throughput_on_tok_s": thr_on,
            "throughput_off_tok_s": thr_off,
            "ratio": thr_on / thr_off,
            "paired_ratios": pairs,
            "paired_median": statistics.median(pairs),
            "paired_ci95": bootstrap_median_ci(pairs),
            "written_MB_s": {
                k: statistics.median(r["written_MB_s"][k] for r in on_rows)
                for k in on_rows[0]["written_MB_s"]
            },
            "dropped": {
                k: statistics.median(r["tiers"][k]["dropped"] for r in on_rows)
                for k in on_rows[0]["tiers"]
            },
            "accounted_ratio": statistics.median(r["accounted_ratio"] for r in on_rows),
            "tier_cpu_s_per_GB": statistics.median(r["tier_cpu_s_per_GB"] or 0.0 for r in on_rows),
            "engine_thread_connector_s": [
                statistics.median(r["engine_thread_connector_s"] for r in rows)
                for rows in (on_rows, off_rows)
            ],
            "cpu_on": median_dicts([r["cpu"] for r in on_rows]),
            "cpu_off": median_dicts([r["cpu"] for r in off_rows]),
            "runs_on": on_rows,
            "runs_off": off_rows,
        }

    out: dict = {}
    warm = prompts_of(rng, 2, 64, st.vocab)
    drive(llm, warm, [dec_sp] * 2)
    for kind in args.decode_kinds:
        # Each round: the detached run and one run per variant, the order rotating.
        conds: list[WriterVariant | None] = [None, *variants]
        rows: dict[str, list[dict]] = {c.spec if c else "off": [] for c in conds}
        for i in range(args.decode_reps):
            k = i % len(conds)
            for c in conds[k:] + conds[:k]:
                rows[c.spec if c else "off"].append(run(kind, c))
            progress(
                f"decode ({kind} stream) round {i + 1}: off {rows['off'][-1]['decode_tok_s']:.1f}"
                + "".join(f", {v.spec} {rows[v.spec][-1]['decode_tok_s']:.1f}" for v in variants)
                + " tok/s"
            )
        res = {v.spec: summary(rows[v.spec], rows["off"]) for v in variants}
        out[kind] = {
            **res[variants[0].spec],
            "variant": variants[0].spec,
            "variants": {
                spec: {k: v for k, v in r.items() if k not in ("runs_on", "runs_off")}
                for spec, r in res.items()
            },
        }
        for spec, r in res.items():
            if spec != variants[0].spec:
                out[kind]["variants"][spec]["runs_on"] = r["runs_on"]
    switch.close()
    llm.shutdown()
    return out


# ------------------------------------------------------------------------------ 4 (windows)
def bootstrap_median_ci(xs: list[float], n: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of ``xs``."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n)]


def verdict(lo: float, hi: float, goal: float) -> str:
    """Goal met / not met by a 95% interval, or not decided by this run."""
    if lo >= goal:
        return f"met (>= {goal:g}: the interval is above it)"
    if hi < goal:
        return f"NOT met (>= {goal:g}: the interval is below it)"
    return f"not decided (>= {goal:g} is inside the interval)"


def switch(event: threading.Event, on: bool) -> None:
    if on:
        event.set()
    else:
        event.clear()


def bench_decode_windows(st: Setup, args, progress) -> dict:
    """Measurement 4 in windows: one engine decodes batch after batch while the heavy stream
    is switched on and off between steps, in pairs of adjacent windows (on/off, then off/on:
    a trend cancels), each window ``win_guard_s`` of settling (an off window also until the
    writes of the stream are acknowledged) and then ``win_s`` measured: decode tokens / wall
    time of the steps in it (the first step of a batch, its prefill, left out). Per pair the
    ratio on/off; the median of ``win_pairs`` ratios with its bootstrap 95% interval. Other
    tenants' load changes over seconds, so adjacent windows see the same machine: hundreds of
    pairs in the time a dozen 7-s run pairs take. The tiers stay attached: an off window's
    tiers get only the engine's own cascade (its decode, ~7 MB/s)."""
    root = st.subdir("windows")
    st.flush_redis()
    chunk_bytes = args.chunk_tokens * st.kv_bytes_per_token
    n_dec = args.decode_batch
    llm = st.llm(
        st.tier_specs(args.decode_tiers, root, args.decode_tier_bytes),
        max(64 * chunk_bytes, 4 * args.decode_prefill_len * st.kv_bytes_per_token),
        max_num_batched_tokens=args.decode_batched_tokens,
        max_num_seqs=n_dec,
        num_threads=args.decode_threads,
    )
    eng = llm.engine
    storage = eng.connector.storage
    fs = [t for t in eng.connector.tiers if t.name == "fs"]
    acct = CpuAccount({"valkey-server": st.redis.proc.pid, "storage-writer": storage.writer.pid})
    rng = random.Random(7)
    sp = SamplingParams(max_tokens=args.win_tokens, temperature=0.0, ignore_eos=True)
    drive(llm, prompts_of(rng, 2, 64, st.vocab), [sp] * 2)  # warm
    active = threading.Event()
    # steps: (previous step's end, this step's end, decode tokens, valid)
    steps: list[tuple[float, float, int, bool]] = []
    # windows: (on, start, measured from, end, cpu seconds by consumer, fs usage at the end)
    windows: list[dict[str, Any]] = []
    n_windows = 2 * args.win_pairs
    variants = [WriterVariant(v) for v in args.win_variants]
    if any(v.mode != "proc" for v in variants):
        raise ValueError("--win-variants: writer process variants only (the engine runs)")
    nv = len(variants)
    # Pair p runs variant p % nv; each variant's pairs alternate on/off and off/on.
    order = [
        w for p in range(args.win_pairs) for w in ((True, False), (False, True))[(p // nv) % 2]
    ]
    undo: Callable[[], None] = variants[0].configure(llm, storage, st.redis.proc.pid)
    t_before = tier_counts(llm)
    with Feeder(storage, eng.connector.tier, args.heavy_mb_s * 1e6, active=active) as feeder:
        prev = time.perf_counter()
        k = 0  # the window running
        on = order[0]
        switch(active, on)
        w_start, w_from = prev, None
        snap = acct.snapshot()
        first = True
        while k < n_windows:
            if not eng.has_unfinished_requests():
                prompts = prompts_of(rng, n_dec, args.decode_prompt_len, st.vocab)
                for p in prompts:
                    eng.add_request(None, p, sp)
                first = True
            outs = eng.step()
            now = time.perf_counter()
            steps.append((prev, now, len(outs), not first))
            first = False
            prev = now
            settled = now - w_start >= args.win_guard_s
            if w_from is None and settled and (on or storage._pending_write_chunks == 0):
                w_from = now  # measured from here (the stream's writes acknowledged)
            if w_from is not None and now - w_from >= args.win_s:
                s2 = acct.snapshot()
                cpu = CpuAccount.diff(snap, s2)
                windows.append(
                    {
                        "on": on,
                        "variant": (k // 2) % nv,
                        "cpu": cpu,
                        "start": w_start,
                        "from": w_from,
                        "end": now,
                        "fs_used": fs[0].usage()[0] if fs else 0,
                    }
                )
                k += 1
                if k < n_windows and k % 2 == 0 and nv > 1:  # a new pair: its variant
                    undo()
                    undo = variants[(k // 2) % nv].configure(llm, storage, st.redis.proc.pid)
                if k < n_windows:
                    on = order[k]
                    switch(active, on)
                    w_start, w_from = now, None
                    snap = acct.snapshot()
                    prev = time.perf_counter()  # the bookkeeping stays out of the windows
        active.clear()
        fed = feeder.chunks
    undo()
    while eng.has_unfinished_requests():
        eng.step()
    t_after = tier_counts(llm)
    llm.shutdown()

    def rate(w: dict[str, Any]) -> tuple[float, float, int]:
        tok = sum(n for a, b, n, ok in steps if ok and a >= w["from"] and b <= w["end"])
        dt = sum(b - a for a, b, n, ok in steps if ok and a >= w["from"] and b <= w["end"])
        nsteps = sum(1 for a, b, n, ok in steps if ok and a >= w["from"] and b <= w["end"])
        return tok, dt, nsteps

    rows = []
    for p in range(args.win_pairs):
        a, b = windows[2 * p], windows[2 * p + 1]
        w_on, w_off = (a, b) if a["on"] else (b, a)
        (tok_on, dt_on, n_on), (tok_off, dt_off, n_off) = rate(w_on), rate(w_off)
        rows.append(
            {
                "variant": a["variant"],
                "tok_on": tok_on, "s_on": dt_on, "steps_on": n_on,
                "tok_off": tok_off, "s_off": dt_off, "steps_off": n_off,
                "fs_full": bool(fs) and w_on["fs_used"] >= 0.9 * fs[0].size_bytes,
            }
        )  # fmt: skip
    # A pair counts when each window has steps enough (a batch boundary can take half of one).
    least = 0.5 * statistics.median(r["steps_on"] + r["steps_off"] for r in rows) / 2
    every = [r for r in rows if min(r["steps_on"], r["steps_off"]) >= least]

    def cpu_per_s(variant: int, on: bool) -> dict[str, float]:
        """CPU seconds per second of the variant's on (off) windows, settling included."""
        ws = [w for w in windows if w["variant"] == variant and w["on"] == on]
        return per_second([w["cpu"] for w in ws], [w["end"] - w["start"] for w in ws])

    cpu_on = [w["cpu"] for w in windows if w["on"] and w["variant"] == 0]
    cpu_off = [w["cpu"] for w in windows if not w["on"] and w["variant"] == 0]
    by_variant: dict[str, Any] = {}
    for i, v in enumerate(variants):
        vr = [(r["tok_on"] / r["s_on"]) / (r["tok_off"] / r["s_off"]) for r in every]
        vr = [x for x, r in zip(vr, every, strict=True) if r["variant"] == i]
        by_variant[v.spec] = {
            "pairs": len(vr),
            "paired_median": statistics.median(vr) if vr else None,
            "paired_ci95": bootstrap_median_ci(vr) if len(vr) >= 10 else None,
            "cpu_on_per_s": cpu_per_s(i, True),
            "cpu_off_per_s": cpu_per_s(i, False),
        }
    kept = [r for r in every if r["variant"] == 0]  # the headline: the first variant
    ratios = [(r["tok_on"] / r["s_on"]) / (r["tok_off"] / r["s_off"]) for r in kept]
    full = [x for x, r in zip(ratios, kept, strict=True) if r["fs_full"]]
    on_s = sum(r["s_on"] for r in kept)
    d = {k: delta(v, t_before[k]) for k, v in t_after.items()}
    on_total = sum(w["end"] - w["start"] for w in windows if w["on"])
    res = {
        "pairs": len(rows),
        "pairs_kept": len(kept),
        "win_s": args.win_s,
        "guard_s": args.win_guard_s,
        "throughput_on_tok_s": sum(r["tok_on"] for r in kept) / on_s,
        "throughput_off_tok_s": sum(r["tok_off"] for r in kept) / sum(r["s_off"] for r in kept),
        "paired_median": statistics.median(ratios),
        "paired_ci95": bootstrap_median_ci(ratios),
        "paired_quartiles": statistics.quantiles(ratios, n=4)[::2]
        if len(ratios) > 1
        else ratios * 2,
        "paired_full": statistics.median(full) if full else None,
        "paired_full_ci95": bootstrap_median_ci(full) if len(full) >= 10 else None,
        "pairs_full": len(full),
        "fed_chunks": fed,
        # Bytes per second of on windows, settling included (and the engine's own cascade;
        # an on window's last writes land in the next window's settling).
        "written_MB_s_on": {k: v["write_bytes"] / on_total / 1e6 for k, v in d.items()},
        "dropped": {k: v["dropped"] for k, v in d.items()},
        "cpu_on": median_dicts(cpu_on),
        "cpu_off": median_dicts(cpu_off),
        # CPU seconds per second of window, by consumer (steal: the machine's, both vCPUs)
        "cpu_on_per_s": cpu_per_s(0, True),
        "cpu_off_per_s": cpu_per_s(0, False),
        "ratios": ratios,
        "pairs_rows": rows,
        "variants": by_variant,
    }
    res["ratio"] = res["throughput_on_tok_s"] / res["throughput_off_tok_s"]
    lo, hi = res["paired_ci95"]
    progress(
        f"windows: paired median {res['paired_median']:.3f} (95% {lo:.3f}-{hi:.3f}, "
        f"{len(kept)} of {len(rows)} pairs); aggregate {res['ratio']:.3f} "
        f"({res['throughput_on_tok_s']:.1f} / {res['throughput_off_tok_s']:.1f} tok/s); "
        + (f"tiers full: {res['paired_full']:.3f} ({len(full)} pairs); " if full else "")
        + "written MB/s "
        + ", ".join(f"{k} {v:.0f}" for k, v in res["written_MB_s_on"].items())
    )
    return res


# ------------------------------------------------------------------------------ 4c
def bench_write_cost(st: Setup, args, progress) -> dict:
    """Measurement 4c: what tier writes cost the engine's process, without the model. The main
    thread runs a pure-Python loop (the engine thread's kind of work between torch calls)
    for ``probe_s`` seconds while a feeder keeps ``probe_mb_s`` MB/s of chunks from a shared
    host tier going into disk, fs and redis: writes in writer threads of this process, in the
    writer process, or none; rounds interleaved, the order rotating. Reported: the loop's rate
    against no writes (GIL hand-offs and CPU taken from this process), this process's and the
    writer process's CPU seconds per chunk written."""
    from kvserve.kv.backends import create_backend
    from kvserve.kv.backends.base import ChunkLayout
    from kvserve.kv.backends.chunk_format import ChunkCodec
    from kvserve.kv.backends.cpu import CpuBackend
    from kvserve.kv.backends.storage import parse_tier_spec

    st.flush_redis()
    root = st.subdir("cost")
    chunk_bytes = args.chunk_tokens * st.kv_bytes_per_token
    layout = ChunkLayout(1, args.chunk_tokens, 1, st.kv_bytes_per_token // 4, "bfloat16")
    assert layout.chunk_bytes == chunk_bytes  # K and V, 2 bytes each
    host = CpuBackend(layout, 64 * chunk_bytes, shared=True)
    for s in range(host.num_slots):  # distinct bytes (a Redis server compares nothing)
        host.slots_u8[s].numpy()[::4096] = s
    codec = ChunkCodec("0123456789abcdef", layout.describe(), chunk_bytes)
    specs = [parse_tier_spec(x) for x in st.tier_specs(TIER_ORDER, root, 4 << 30)]
    tiers = [create_backend(sp.type, codec, **sp.options) for sp in specs]
    workers = {
        "thread": StorageWorker(tiers),
        "proc": StorageWorker(tiers, write_process=True, host=host, specs=specs),
    }
    writer_pid = workers["proc"].writer.pid
    acct = CpuAccount({"writer": writer_pid})

    def spin(seconds: float) -> float:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(1000):
                pass
            n += 1
        return n / seconds

    def run(mode: str) -> dict:
        if mode == "none":
            c0 = acct.snapshot()
            rate = spin(args.probe_s)
            return {"loop_rate": rate, "chunks": 0, "cpu": CpuAccount.diff(c0, acct.snapshot())}
        w = workers[mode]
        f = Feeder(w, host, args.probe_mb_s * 1e6, batch=4)
        f.__enter__()
        time.sleep(0.2)  # the stream under way
        c0 = acct.snapshot()
        w0 = sum(t.stats.written for t in tiers)
        rate = spin(args.probe_s)
        c1 = acct.snapshot()
        w1 = sum(t.stats.written for t in tiers)
        f.__exit__(None, None, None)
        for _ in w.poll():
            pass
        cpu = CpuAccount.diff(c0, c1)
        chunks = (w1 - w0) / len(tiers)
        return {"loop_rate": rate, "chunks": chunks, "cpu": cpu}

    conds = ["none", "thread", "proc"]
    rows: dict[str, list[dict]] = {c: [] for c in conds}
    try:
        for i in range(args.probe_rounds):
            for c in conds[i % 3 :] + conds[: i % 3]:
                rows[c].append(run(c))
            progress(
                "write cost round "
                + f"{i + 1}: loop rate vs none: "
                + ", ".join(
                    f"{c} {rows[c][-1]['loop_rate'] / rows['none'][-1]['loop_rate']:.3f}"
                    for c in conds[1:]
                )
            )
    finally:
        workers["proc"].shutdown()  # closes the tiers
        workers["thread"]._reads.shutdown(wait=True)
        workers["thread"]._writes.shutdown(wait=True)
        host.close()
    out: dict = {"probe_s": args.probe_s, "mb_s": args.probe_mb_s, "rounds": rows}
    for c in conds[1:]:
        pairs = [
            a["loop_rate"] / b["loop_rate"] for a, b in zip(rows[c], rows["none"], strict=True)
        ]
        chunks = sum(r["chunks"] for r in rows[c])
        proc_cpu = sum(r["cpu"]["process"] for r in rows[c]) - sum(
            r["cpu"]["process"] for r in rows["none"]
        )
        writer_cpu = sum(r["cpu"].get("proc:writer", 0.0) for r in rows[c])
        out[c] = {
            "loop_ratio": statistics.median(pairs),
            "paired": sorted(pairs),
            "chunks_per_s": chunks / (args.probe_s * len(rows[c])),
            "process_cpu_ms_per_chunk": 1e3 * proc_cpu / chunks if chunks else None,
            "writer_cpu_ms_per_chunk": 1e3 * writer_cpu / chunks if chunks else None,
        }
    return out


# ------------------------------------------------------------------------------ 4v
def bench_valkey_memory(st: Setup, args, progress) -> dict:
    """Measurement 4v: what a Redis-compatible server spends per stored chunk while the redis
    tier writes a stream into it, by phase: filling to ``maxmemory``, the first ``maxmemory``
    of values evicting older ones, the next ``maxmemory`` (steady). Arms, each a fresh server
    of its own, interleaved rounds with the order rotating: ``reuse`` (the launcher's default:
    glibc's malloc told to keep evicted values' memory for the next ones) and
    ``glibc-defaults`` (its dynamic mmap threshold: values mmapped and unmapped). Reported per
    phase: the server's minor page faults and CPU milliseconds per chunk."""
    from kvserve.kv.backends import create_backend
    from kvserve.kv.backends.chunk_format import ChunkCodec
    from kvserve.kv.backends.storage import parse_size

    chunk_bytes = args.chunk_tokens * st.kv_bytes_per_token
    codec = ChunkCodec("0123456789abcdef", "valkey-memory-probe", chunk_bytes)
    n_src = 64
    src = mmap.mmap(-1, n_src * chunk_bytes)
    for s in range(n_src):  # distinct bytes (the server compares nothing; the hash does)
        src[s * chunk_bytes : s * chunk_bytes + 16] = os.urandom(16)
    view = memoryview(src)
    payloads = [view[s * chunk_bytes : (s + 1) * chunk_bytes] for s in range(n_src)]
    maxmemory = parse_size(args.valkey_maxmemory)
    per_phase = max(1, maxmemory // chunk_bytes)
    phases = ("fill", "first-turnover", "steady")
    batch = 4
    period = batch * chunk_bytes / (args.heavy_mb_s * 1e6) if args.heavy_mb_s > 0 else 0.0
    arms = {"reuse": True, "glibc-defaults": False}
    rows: dict[str, list[dict[str, dict[str, float]]]] = {a: [] for a in arms}
    allocator = None
    for rnd in range(args.valkey_rounds):
        order = list(arms) if rnd % 2 == 0 else list(reversed(arms))
        for arm in order:
            srv = RedisServer(maxmemory=maxmemory, reuse_freed_memory=arms[arm]).start()
            tier = create_backend("redis", codec, url=srv.url)
            try:
                allocator = srv.client().info("memory").get("mem_allocator")
                pid = srv.proc.pid
                out: dict[str, dict[str, float]] = {}
                i = 0
                next_t = time.perf_counter()
                for phase in phases:
                    f0, c0 = proc_faults_cpu(pid)
                    t0 = time.perf_counter()
                    for _ in range(0, per_phase, batch):
                        keys = [b"%032d" % (i + j) for j in range(batch)]
                        tier.put(keys, [payloads[(i + j) % n_src] for j in range(batch)])
                        i += batch
                        if period:
                            next_t += period
                            wait = next_t - time.perf_counter()
                            if wait > 0:
                                time.sleep(wait)
                    f1, c1 = proc_faults_cpu(pid)
                    n = -(-per_phase // batch) * batch
                    out[phase] = {
                        "faults_per_chunk": (f1 - f0) / n,
                        "cpu_ms_per_chunk": (c1 - c0) * 1e3 / n,
                        "MB_s": n * chunk_bytes / (time.perf_counter() - t0) / 1e6,
                    }
                out["evicted"] = {"keys": float(srv.client().info("stats")["evicted_keys"])}
            finally:
                tier.close()
                srv.close()
            rows[arm].append(out)
            progress(
                f"valkey {arm} round {rnd}: "
                + ", ".join(
                    f"{p} {out[p]['faults_per_chunk']:.0f} faults {out[p]['cpu_ms_per_chunk']:.2f}"
                    " ms"
                    for p in phases
                )
            )
    summary = {
        arm: {
            p: {
                k: statistics.median(r[p][k] for r in rs)
                for k in ("faults_per_chunk", "cpu_ms_per_chunk", "MB_s")
            }
            for p in phases
        }
        for arm, rs in rows.items()
    }
    return {
        "maxmemory": maxmemory,
        "chunks_per_phase": per_phase,
        "mem_allocator": allocator,
        "rounds": rows,
        "median": summary,
    }


# ------------------------------------------------------------------------------ 5
def bench_hit_rate(st: Setup, args, progress) -> dict:
    L = args.ws_prompt_len
    prompt_bytes = L * st.kv_bytes_per_token
    host_bytes = args.ws_host_prompts * prompt_bytes
    n_ws = 4 * args.ws_host_prompts  # working set: 4x what the host tier holds
    root = st.subdir("hitrate")
    # Storage hits are staged through host-tier slots, reserved when the request is admitted
    # (requests waiting for KV do not count against max_num_seqs): a client keeps at most half
    # of the host tier's prompts in flight, so staging never runs out of host slots (a hit that
    # finds none is recomputed, which would measure the host tier's size, not the disk tier).
    seqs = max(1, args.ws_host_prompts // 2)
    llm = st.llm(st.tier_specs(("disk",), root, 4 * n_ws * prompt_bytes), host_bytes)
    switch = StorageSwitch(llm)
    conn = llm.engine.connector
    rng = random.Random(6)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    working = prompts_of(rng, n_ws, L, st.vocab)
    # Warm-up: every prompt stored in the host tier and cascaded to disk, one at a time (a
    # chunk reaches the disk only through a host slot, pinned until its write ends).
    for p in working:
        drive(llm, [p], [sp])
    disk = tier_by_name(llm, "disk")
    per_prompt = L // args.chunk_tokens
    held = len(disk._index)
    assert held >= n_ws * per_prompt, f"disk tier holds {held} chunks of {n_ws * per_prompt}"
    progress(f"working set: {n_ws} prompts x {L} tokens stored on disk ({held} chunks)")
    n = args.ws_batch
    points = []
    for frac in args.hit_rates:
        row: dict = {"reuse": frac}
        for i, on in enumerate((True, False) if len(points) % 2 == 0 else (False, True)):
            del i
            k = round(frac * n)
            batch = rng.sample(working, k) + prompts_of(rng, n - k, L, st.vocab)
            rng.shuffle(batch)
            switch.set("proc" if on else None)
            llm.reset_prefix_cache()
            before = conn.stats()
            outs, t_done, drained = drive(llm, batch, [sp] * n, concurrency=seqs)
            after = conn.stats()
            t = max(t_done)
            # Tokens actually loaded (a claimed hit whose load failed is recomputed: 0).
            hit = sum(o.metrics.num_external_cached_tokens for o in outs) / (n * L)
            from_disk = after.extra["tier_loaded_chunks"] - before.extra["tier_loaded_chunks"]
            failed = after.extra["rejected_chunks"] - before.extra["rejected_chunks"]
            row["on" if on else "off"] = {
                "throughput_tok_s": n * L / t,
                "hit_rate": hit,
                "disk_hit_rate": from_disk * args.chunk_tokens / (n * L),
                "seconds": t,
                "drain_s": drained - t,
                "host_rejected_chunks": failed,
            }
            switch.set("proc")
        points.append(row)
        progress(
            f"reuse {frac:.0%}: disk on {row['on']['throughput_tok_s']:.0f} tok/s "
            f"(hits {row['on']['hit_rate']:.0%}), off {row['off']['throughput_tok_s']:.0f} tok/s "
            f"(hits {row['off']['hit_rate']:.0%})"
        )
    llm.shutdown()
    return {
        "prompt_len": L,
        "working_set_prompts": n_ws,
        "working_set_bytes": n_ws * prompt_bytes,
        "host_tier_bytes": host_bytes,
        "batch": n,
        "concurrency": seqs,
        "points": points,
    }


def plot(hr: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = hr["points"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for side, style in (("on", "o-"), ("off", "s--")):
        label = "disk tier on" if side == "on" else "disk tier off (host tier only)"
        y = [p[side]["throughput_tok_s"] for p in pts]
        axes[0].plot([100 * p["reuse"] for p in pts], y, style, label=label)
        axes[1].plot([100 * p[side]["hit_rate"] for p in pts], y, style, label=label)
    axes[0].set_xlabel("requests re-using a working-set prompt (%)")
    axes[1].set_xlabel("measured hit rate (% of prompt tokens from host + disk tiers)")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_ylabel("prefill throughput (tok/s, log scale)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", default=None, help="an existing model directory (else made)")
    ap.add_argument("--quick", action="store_true", help="tiny preset, small sizes (smoke run)")
    ap.add_argument("--tier-dir", default=None, help="where disk/fs tiers live (/var/tmp)")
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--redis-maxmemory", default="2gb")
    ap.add_argument(
        "--redis-malloc-defaults", action="store_true",
        help="start the benchmark's server with glibc malloc's defaults (the launcher's "
        "GLIBC_MALLOC_REUSE off: evicted values unmapped, the next ones faulted in)",
    )  # fmt: skip
    ap.add_argument("--valkey-maxmemory", default="256MiB", help="maxmemory of 4v's servers")
    ap.add_argument("--valkey-rounds", type=int, default=2, help="interleaved rounds of 4v")
    ap.add_argument(
        "--tier-option", action="append", default=[], metavar="TIER:KEY=VALUE",
        help="an option added to every spec of that tier (fs:o_direct=false), repeatable",
    )  # fmt: skip
    ap.add_argument("--ttft-len", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3, help="prompts of measurement 1")
    ap.add_argument("--cross-reps", type=int, default=2, help="prompts of measurement 2")
    ap.add_argument("--decode-kinds", nargs="*", default=["own", "heavy"])
    ap.add_argument("--decode-reps", type=int, default=3, help="pairs per kind (4)")
    ap.add_argument("--decode-tiers", nargs="+", default=list(TIER_ORDER), help="tiers of 4")
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument(
        "--decode-tokens", type=int, default=256,
        help="tokens per decode of 4 (shorter runs end before a starved SCHED_IDLE writer wrote)",
    )  # fmt: skip
    ap.add_argument("--decode-prefills", type=int, default=4)
    ap.add_argument("--decode-prefill-len", type=int, default=1024)
    ap.add_argument("--decode-batched-tokens", type=int, default=512)
    ap.add_argument("--decode-threads", type=int, default=None, help="torch threads of 4")
    ap.add_argument(
        "--decode-variants", nargs="+", default=["proc", "thread"],
        help="writer settings of 4's runs with tiers (first: the headline), each against the "
        "same detached runs: +-joined proc|thread, idle|nice|normal, gap, duty=F, srvidle, "
        "fsbuf, fsdirect (WriterVariant)",
    )  # fmt: skip
    ap.add_argument(
        "--heavy-mb-s", type=float, default=100.0,
        help="the heavy stream of 4, MB/s into every tier (0: as fast as they absorb)",
    )  # fmt: skip
    ap.add_argument("--decode-tier-bytes", type=int, default=2 << 30)
    ap.add_argument("--win-pairs", type=int, default=200, help="pairs of windows of 4 (windows)")
    ap.add_argument("--win-s", type=float, default=0.5, help="measured seconds of a window")
    ap.add_argument("--win-guard-s", type=float, default=0.15, help="settling before it")
    ap.add_argument("--win-tokens", type=int, default=512, help="tokens per decode batch")
    ap.add_argument(
        "--win-variants", nargs="+", default=["proc"],
        help="writer settings of 4 (windows), one per pair in turn (first: the headline); "
        "writer-process forms of --decode-variants (proc+fsdirect, proc+srvidle, ...)",
    )  # fmt: skip
    ap.add_argument("--ws-prompt-len", type=int, default=1024)
    ap.add_argument("--ws-host-prompts", type=int, default=4)
    ap.add_argument("--ws-batch", type=int, default=8)
    ap.add_argument("--hit-rates", type=float, nargs="+", default=[0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--read-rounds", type=int, default=7, help="interleaved rounds of 3")
    ap.add_argument("--probe-s", type=float, default=3.0, help="seconds of each run of 4c")
    ap.add_argument("--probe-rounds", type=int, default=5, help="interleaved rounds of 4c")
    ap.add_argument("--probe-mb-s", type=float, default=60.0, help="4c's stream, MB/s")
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="ttft read cross decode windows cost valkey hitrate",
    )
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--out", default=None, help="results basename (default tiers_<preset>)")
    args = ap.parse_args(argv)
    options: dict[str, list[str]] = {}
    for opt in args.tier_option:
        tier, colon, kv = opt.partition(":")
        if not colon or "=" not in kv or tier not in TIER_ORDER:
            ap.error(f"--tier-option {opt!r}: expected TIER:KEY=VALUE, TIER one of {TIER_ORDER}")
        options.setdefault(tier, []).append(kv)
    args.tier_option = options
    for v in args.decode_variants:
        WriterVariant(v)  # a typo fails now, not after the set-up
    if args.quick:
        args.preset = "tiny"
        args.ttft_len, args.reps, args.cross_reps = 1024, 1, 1
        args.decode_reps, args.decode_tokens, args.decode_prefills = 1, 16, 2
        args.win_pairs, args.win_s, args.win_guard_s, args.win_tokens = 4, 0.15, 0.05, 64
        args.decode_prefill_len, args.decode_tier_bytes = 256, 256 << 20
        args.ws_prompt_len, args.ws_host_prompts, args.ws_batch = 256, 2, 4
        args.hit_rates = [0.0, 1.0]
        args.redis_maxmemory = "512mb"
        args.probe_s, args.probe_rounds = 0.5, 2
        args.valkey_maxmemory, args.valkey_rounds = "32MiB", 1
        args.out = args.out or "tiers_quick"
    return args


def main(argv: list[str] | None = None) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    args = parse_args(argv)
    steps = [
        s
        for s in ("ttft", "read", "cross", "decode", "windows", "cost", "valkey", "hitrate")
        if s not in args.skip
    ]
    st = Setup(args)
    res: dict = {"preset": args.preset, "args": vars(args)}
    res["tier_dir"] = str(st.dir)
    res["tier_fs"] = fs_type(st.dir)
    res["redis_server"] = server_version(st.redis.binary)
    res["kv_bytes_per_token"] = st.kv_bytes_per_token
    res["chunk_bytes"] = st.kv_bytes_per_token * args.chunk_tokens
    load0 = os.getloadavg()[0]
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(), transient=True
    ) as bar:
        task = bar.add_task("tiers", total=len(steps))

        def progress(msg: str) -> None:
            bar.console.print(f"  {msg}")

        fns = {
            "ttft": bench_ttft_tiers,
            "read": bench_read_ratio,
            "cross": bench_cross_instance,
            "decode": bench_decode,
            "windows": bench_decode_windows,
            "cost": bench_write_cost,
            "valkey": bench_valkey_memory,
            "hitrate": bench_hit_rate,
        }
        try:
            for name in steps:
                bar.update(task, description=name)
                bar.console.print(f"[bold]{name}[/]")
                res[name] = fns[name](st, args, progress)
                bar.advance(task)
        finally:
            st.close()
    res["machine"] = describe_machine()
    res["loadavg_1m_start"] = round(load0, 2)
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / (args.out or f"tiers_{args.preset}")
    base.with_suffix(".json").write_text(json.dumps(res, indent=2))
    if "hitrate" in res:
        plot(res["hitrate"], base.with_suffix(".png"), f"disk tier, working set 4x host tier, "
             f"{args.preset}")  # fmt: skip
    base.with_suffix(".md").write_text(report(res, base.name))
    print(f"wrote {base}.{{json,md{',png' if 'hitrate' in res else ''}}}")
    return res


def _goal(value: float, goal: float) -> str:
    return f"{'met' if value >= goal else 'NOT met'} (>= {goal:g})"


def report(res: dict, name: str) -> str:
    a = res["args"]
    lines = [
        f"# KV storage tiers below host memory — `{res['preset']}` preset",
        "",
        machine_markdown(res["machine"]).rstrip(),
        f"- Load average (1 min) at the start: {res['loadavg_1m_start']}",
        f"- Tier directory: `{res['tier_dir']}` on {res['tier_fs']}; Redis-compatible server: "
        f"{res['redis_server']} on loopback (persistence off, maxmemory {a['redis_maxmemory']})",
        f"- Offload chunk: {a['chunk_tokens']} tokens = {res['chunk_bytes'] / 2**20:.2f} MiB "
        f"({res['kv_bytes_per_token']} bytes of KV per token)",
        "",
        "Command: `python benchmarks/bench_tiers.py"
        + (" --quick" if a["quick"] else f" --preset {res['preset']}")
        + f"`; args: `{json.dumps({k: v for k, v in a.items() if k != 'results_dir'})}`",
        "",
        "| measurement | result | goal |",
        "| --- | --- | --- |",
    ]
    goals = {"disk": 5.0, "fs": 5.0, "fs-cold": 5.0, "redis": 3.0}
    if "ttft" in res:
        t = res["ttft"]
        c = statistics.median(t["recompute_s"])
        for tier in TTFT_RUNS:
            r = t[tier]
            lines.append(
                f"| 1. TTFT {t['prompt_tokens']} tokens, recompute / from `{tier}` | "
                f"{r['speedup']:.1f}x ({c * 1e3:.0f} / {r['ttft_median_s'] * 1e3:.0f} ms) | "
                f"{_goal(r['speedup'], goals[tier])} |"
            )
    if "ttft" in res:
        t = res["ttft"]
        h = statistics.median(t["host_tier_s"])
        c = statistics.median(t["recompute_s"])
        lines.append(
            f"| 1'. the same from the host tier (reference: what a storage hit adds to) | "
            f"{c / h:.1f}x ({c * 1e3:.0f} / {h * 1e3:.0f} ms) | - |"
        )
    if "cross" in res:
        x = res["cross"]
        c = statistics.median(x["recompute_s"])
        for tier in ("fs", "redis"):
            r = x[tier]
            lines.append(
                f"| 2. TTFT on B of A's {x['prompt_tokens']}-token prompt via `{tier}`: B "
                f"recompute / B from tier | {r['speedup']:.1f}x ({c * 1e3:.0f} / "
                f"{r['ttft_median_s'] * 1e3:.0f} ms) | {_goal(r['speedup'], 3.0)} |"
            )
    if "read" in res:
        rd = res["read"]
        for tier in TTFT_RUNS:
            r = rd[tier]
            m = r["median_GB_s"]
            lines.append(
                f"| 3. `{tier}` read bandwidth / raw read of the same bytes | "
                f"{r['ratio_median']:.2f} (rounds {min(r['ratios']):.2f}-{max(r['ratios']):.2f};"
                f" {m['tier']:.2f} GB/s; raw {m['raw']:.2f} with {rd['io_threads']} threads, "
                + (f"{m['raw_c']:.2f} with {rd['cached_read_threads']}, " if "raw_c" in m else "")
                + f"{m['raw_1']:.2f} with one"
                + (f"; the tier with one thread {m['tier_1']:.2f}" if "tier_1" in m else "")
                + (
                    f"; its read in Python {m['tier_py']:.2f}, ratio "
                    f"{statistics.median(r['ratios_py']):.2f}"
                    if "tier_py" in m
                    else ""
                )
                + f") | {_goal(r['ratio_median'], 0.7)} |"
            )
            if "busy_native_over_py" in r:
                lines.append(
                    f"| 3'. `{tier}` read while the engine's thread runs Python: C read / "
                    "Python read | "
                    f"{statistics.median(r['busy_native_over_py']):.1f}x ({m['tier_busy']:.2f} "
                    f"/ {m['tier_py_busy']:.2f} GB/s) | - |"
                )
    what = {
        "own": "the engine's own stream (decode batch + long prompts prefilling, cascaded)",
        "heavy": f"a heavy stream ({a['heavy_mb_s']:g} MB/s of unique chunks into every tier)"
        if a["heavy_mb_s"]
        else "a heavy stream (write queue kept full of unique chunks)",
    }
    for kind, d in res.get("decode", {}).items():
        head = d.get("variant", "nice")
        for spec, v in d.get("variants", {head: d}).items():
            mbs = ", ".join(f"{k} {x:.0f}" for k, x in v["written_MB_s"].items())
            drops = ", ".join(f"{k} {x:.0f}" for k, x in v.get("dropped", {}).items())
            label = (
                f"4. decode throughput, tiers absorbing {what[kind]} / tiers detached "
                f"(writers: `{spec}`)"
                if spec == head
                else f"4'. the same, writers `{spec}`"
            )
            lines.append(
                f"| {label} | {v['ratio']:.3f} ({v['throughput_on_tok_s']:.1f} / "
                f"{v['throughput_off_tok_s']:.1f} tok/s; paired "
                f"{', '.join(f'{p:.3f}' for p in v['paired_ratios'])}; their median "
                f"{v['paired_median']:.3f}, 95% {v['paired_ci95'][0]:.3f}-"
                f"{v['paired_ci95'][1]:.3f}; written MB/s: {mbs}"
                + (f"; chunks dropped per run: {drops}" if drops else "")
                + f") | {_goal(v['ratio'], 0.97) if spec == head else '-'} |"
            )
        lines.append(
            f"| 4b. the same by accounting (writers `{head}`): engine CPU / (engine CPU + the "
            f"tiers' CPU) | {d['accounted_ratio']:.3f} (tiers: {d['tier_cpu_s_per_GB']:.2f} CPU "
            f"s per GB stored) | {_goal(d['accounted_ratio'], 0.97)} |"
        )
    if "windows" in res:
        w = res["windows"]
        lo, hi = w["paired_ci95"]
        q1, q3 = w["paired_quartiles"]
        mbs = ", ".join(f"{k} {x:.0f}" for k, x in w["written_MB_s_on"].items())
        drops = ", ".join(f"{k} {x:.0f}" for k, x in w["dropped"].items())
        full = ""
        if w["paired_full"] is not None:
            full = f"; pairs with the fs tier full (evicting): {w['paired_full']:.3f}"
            if w["paired_full_ci95"]:
                flo, fhi = w["paired_full_ci95"]
                full += f" (95% {flo:.3f}-{fhi:.3f}, {w['pairs_full']} pairs)"
        lines.append(
            f"| 4w. decode throughput, tiers absorbing {what['heavy']} / the same tiers without "
            f"it, in adjacent windows ({w['win_s']:g} s measured each, {w['pairs_kept']} pairs) "
            f"| median of paired ratios {w['paired_median']:.3f} (95% bootstrap interval "
            f"{lo:.3f}-{hi:.3f}, quartiles {q1:.3f}-{q3:.3f}; aggregate {w['ratio']:.3f}: "
            f"{w['throughput_on_tok_s']:.1f} / {w['throughput_off_tok_s']:.1f} tok/s{full}; "
            f"written MB/s in on windows: {mbs}; chunks dropped: {drops}) "
            f"| {verdict(lo, hi, 0.97)} |"
        )
        if len(w.get("variants", {})) > 1:
            parts = []
            for spec, v in w["variants"].items():
                ci = v["paired_ci95"]
                ci_s = f" (95% {ci[0]:.3f}-{ci[1]:.3f})" if ci else ""
                parts.append(f"`{spec}` {v['paired_median']:.3f}{ci_s}, {v['pairs']} pairs")
            lines.append(
                "| 4w''. the same by writer setting, pairs of each in turn | "
                + "; ".join(parts)
                + " | - |"
            )
        if "cpu_on_per_s" in w:
            on, off = w["cpu_on_per_s"], w["cpu_off_per_s"]
            parts = [
                f"{label} {on.get(k, 0.0):.3f} / {off.get(k, 0.0):.3f}"
                for k, label in (
                    ("thread:MainThread", "engine thread"),
                    ("proc:storage-writer", "writer process"),
                    ("proc:valkey-server", "Valkey"),
                    ("machine", "machine busy"),
                    ("steal", "steal (hypervisor)"),
                )
            ]
            lines.append(
                "| 4w'. CPU seconds per second of window, stream on / off (settling included) | "
                + "; ".join(parts)
                + " | - |"
            )
    if "cost" in res:
        c = res["cost"]
        for mode, label in (("proc", "the writer process"), ("thread", "writer threads")):
            v = c[mode]
            lines.append(
                f"| 4c. a Python loop in the engine's process while {c['mb_s']:g} MB/s go to "
                f"disk + fs + redis through {label} / no writes | {v['loop_ratio']:.3f} (paired "
                f"{', '.join(f'{p:.3f}' for p in v['paired'])}; {v['chunks_per_s']:.0f} chunks/s"
                f" written; CPU per chunk: this process {v['process_cpu_ms_per_chunk']:.2f} ms, "
                f"the writer process {v['writer_cpu_ms_per_chunk']:.2f} ms) | - |"
            )
    if "valkey" in res:
        v = res["valkey"]
        labels = {"reuse": "the launcher's default (evicted values' memory reused)",
                  "glibc-defaults": "glibc malloc's defaults"}  # fmt: skip
        for arm, phases in v["median"].items():
            lines.append(
                f"| 4v. the server per stored chunk at {a['heavy_mb_s']:g} MB/s "
                f"(maxmemory {v['maxmemory'] / 2**20:.0f} MiB, {v['mem_allocator']}), "
                f"{labels.get(arm, arm)}: page faults, CPU | "
                + "; ".join(
                    f"{p} {x['faults_per_chunk']:.1f} faults, {x['cpu_ms_per_chunk']:.2f} ms"
                    for p, x in phases.items()
                )
                + f" (medians of {len(v['rounds'][arm])} rounds) | - |"
            )
    if "hitrate" in res:
        h = res["hitrate"]
        top = h["points"][-1]
        lines.append(
            f"| 5. prefill throughput at {top['reuse']:.0%} reuse, working set 4x host tier: "
            f"disk on / off | {top['on']['throughput_tok_s'] / top['off']['throughput_tok_s']:.2f}x"
            f" ({top['on']['throughput_tok_s']:.0f} / {top['off']['throughput_tok_s']:.0f} tok/s; "
            f"hits {top['on']['hit_rate']:.0%} / {top['off']['hit_rate']:.0%}) | plotted |"
        )
        lines += [
            "",
            f"Throughput vs hit rate: working set {h['working_set_prompts']} prompts x "
            f"{h['prompt_len']} tokens ({h['working_set_bytes'] / 2**20:.0f} MiB of KV), host "
            f"tier {h['host_tier_bytes'] / 2**20:.0f} MiB; batches of {h['batch']} prefill-only "
            f"requests ({h['concurrency']} in flight), a fraction re-using working-set prompts, "
            "the rest fresh; primary prefix cache reset before each batch.",
            "",
            "| reuse | disk on: tok/s | hits (of which disk) | disk off: tok/s | hits | on / off |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for p in h["points"]:
            on, off = p["on"], p["off"]
            lines.append(
                f"| {p['reuse']:.0%} | {on['throughput_tok_s']:.0f} | {on['hit_rate']:.0%} "
                f"({on['disk_hit_rate']:.0%}) | {off['throughput_tok_s']:.0f} | "
                f"{off['hit_rate']:.0%} | {on['throughput_tok_s'] / off['throughput_tok_s']:.2f} |"
            )
        lines += ["", f"![throughput vs hit rate]({name}.png)"]
    if "decode" in res:
        lines += ["", "CPU seconds per decode run (medians; tiers on / off):", ""]
        for kind, d in res["decode"].items():
            on, off = d["cpu_on"], d["cpu_off"]
            keys = [k for k in on if max(on.get(k, 0), off.get(k, 0)) >= 0.01]
            c_on, c_off = d["engine_thread_connector_s"]
            lines.append(
                f"- {kind}: "
                + ", ".join(f"{k} {on.get(k, 0):.2f} / {off.get(k, 0):.2f}" for k in keys)
                + f"; the engine thread in connector calls {c_on:.3f} / {c_off:.3f} s"
            )
    lines += [
        "",
        "Method notes:",
        "",
        "- 1: one engine, hierarchy host -> disk -> fs -> redis. Per prompt: recomputed once "
        "(TTFT baseline), then served from disk, from fs (its chunks removed from disk) and "
        "from redis (removed from fs), the primary prefix cache and the host tier emptied "
        "before each run; a lower tier's lookup first asks the tiers above it. `fs` reads "
        "files the page cache holds (read once before it: the tier writes with O_DIRECT "
        "where the file system takes it, so a chunk is cached on a node once a reader there "
        "read it); `fs-cold` first writes them back and drops them from the page cache, so "
        "the read goes to the device. The same in 3.",
        "- 2: instances A and B are two engines in one process (own host tiers, storage "
        "workers and tier clients; the same fs directory and Valkey server); B's baseline "
        "recomputes a fresh prompt of the same length.",
        "- 3: one engine, one prompt's chunks in every tier. Tier read = payload bytes / wall "
        "time of the storage worker's read of all of them (a staging read, from submission to "
        "the last chunk verified: the I/O threads, one task per thread taking groups of "
        "contiguous chunks, one `get()` call per group; from the fs tier `cached_read_threads` "
        "threads until a chunk waits on the device) into page-aligned memory of their "
        "own. Raw = the same chunks read plainly: disk slots with `preadv` (O_DIRECT as the "
        "tier), fs files with open/read/close, redis values with pipelined GETs (as deep as "
        "the tier's groups) written to a plain socket, each value received straight into its "
        "buffer (redis-py's own pipeline is recorded too, `raw_redis_py`), with the tier's "
        "concurrency, the tier's page-cache concurrency (fs, `raw_c`) and one thread, each "
        "kind into page-aligned memory of its own allocated once and reused every round, as "
        "the tier's (fresh pages, just zeroed by the kernel, would start cache-hot). Rounds "
        "of the reads, interleaved, the order "
        "rotating; the ratio is the median over rounds of the tier against the fastest raw "
        "read of its round (`fs-cold`: the page cache dropped before every read). The fs "
        "tier's files are read in C without the GIL (`_fs_read`); its read in Python (as "
        "without the extension: three GIL releases per file) is measured in the same rounds "
        "as a reference (`tier_py`). 3': both fs reads (from the page cache) while the engine's "
        "thread runs pure Python until the result comes, polling the storage worker every 2 "
        "ms (an engine step's scheduling and output work, at its most GIL-bound: the GIL "
        "released only at the switch interval, 5 ms), in the same rounds; per round the C "
        "read over the Python read.",
        "- 4: one engine, its storage worker detached between runs for the baseline; "
        "interleaved pairs with alternating order. The heavy stream comes from a feeder thread "
        "submitting unique chunks to the engine's storage worker at a fixed rate (what a much "
        "faster prefill's cascade would do; this engine's own prefill, ~900 tok/s of `small` "
        "here, stores ~22 MB/s). 4b: CPU seconds by thread (`/proc/self/task/*/schedstat`) "
        "and of the Valkey server (`/proc/PID/stat`): immune to other tenants' load, blind to "
        "GIL waits and to torch's OpenMP threads stalled by a preempted peer; on a machine "
        "whose cores the engine keeps busy, each CPU second of tier work is one the forward "
        "does not get. Writer variants (each against the same detached runs, all interleaved, "
        "order rotating): `proc` = writes in the engine's writer process (the default: the "
        "host tier in shared memory, keys and offsets sent over a socket, the process hashes "
        "and writes), `thread` = writer threads in the engine's own process (the previous "
        "design: a second storage worker on the same tiers), `idle` / `nice` / `normal` = the "
        "writers under `SCHED_IDLE` (the default), nice 19, or as the engine's threads, `gap` "
        "= writes paused while a step's forward runs (`kv_tier_write_pause`), `srvidle` = the "
        "local Valkey server under `SCHED_IDLE` too, `fsbuf` / `fsdirect` = the fs tier's "
        "writes buffered (through the page cache) / with O_DIRECT. Each chunk is hashed once "
        "for all tiers.",
        "- 4 (windows): one engine decodes batch after batch (batches of "
        f"{a['decode_batch']} x {a['win_tokens']} tokens) while the heavy stream is switched "
        "on and off between steps, in pairs of adjacent windows, on/off then off/on (a trend "
        "within a batch cancels); each window first settles (`win_guard_s`; an off window "
        "also until every write of the stream was acknowledged), then `win_s` of steps are "
        "measured: decode tokens / wall time from the end of the step before each to its end "
        "(a batch's first step, its prefill, left out; a pair with a window cut short by a "
        "batch's end is dropped). Tiers stay attached: an off window's tiers get only the "
        "engine's own cascade. The tiers start empty and fill during the run (2 GiB at the "
        "stream's rate: ~30 s of on windows); pairs once the fs tier is full are reported "
        "apart. Other tenants' load changes over seconds: adjacent windows see the same "
        "machine, hence hundreds of pairs with a tight interval in the time a dozen 7-s run "
        "pairs take. Verdict by the 95% bootstrap interval of the median paired ratio. "
        "With several writer settings (`--win-variants`, the forms of 4's variants that keep "
        "the writer process), pair p runs setting p mod n (set between two steps), each "
        "setting's pairs alternating on/off and off/on; the headline is the first setting's. "
        "4w': CPU seconds per second of window by consumer, on windows against off windows, "
        "settling included; `steal` is the machine's steal time (/proc/stat: the hypervisor "
        "running something else on our vCPUs), which a thread's CPU time leaves out and wall "
        "time does not.",
        "- 4c: no model: the main thread counts iterations of a pure-Python loop (what the "
        "engine thread does between torch calls) while a feeder thread submits chunks from a "
        "host tier in shared memory at a fixed rate to a storage worker over disk + fs + "
        "redis, its writes in writer threads of this process or in its writer process, or "
        "no writes; interleaved rounds. CPU per chunk: this process's CPU time above the "
        "no-write runs' (the feeder's included), the writer process's from `/proc/PID/stat`.",
        "- 4v: no model: a redis tier writes unique chunks at the heavy stream's rate into a "
        "fresh server per arm (maxmemory `--valkey-maxmemory`, LRU eviction), one maxmemory "
        "of chunks per phase: filling, the first turnover (each store evicts an older chunk), "
        "steady; the server's minor page faults and CPU time from `/proc/PID/stat` per chunk. "
        "Arms in interleaved rounds, the order rotating: `reuse` (the launcher's default, "
        "`GLIBC_MALLOC_REUSE`: a fixed mmap threshold above a chunk and a trim threshold, so "
        "a glibc-malloc server reuses evicted values' memory) and `glibc-defaults` (glibc's "
        "dynamic mmap threshold: each value its own mapping until one is freed, evicted values "
        "unmapped, the next ones faulted in). A jemalloc server ignores the setting. "
        "`--redis-malloc-defaults` starts the other measurements' server the old way.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
