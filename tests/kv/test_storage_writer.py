"""The storage writer process (kv/offload/storage_writer.py) on real tiers: disk and fs in a
temporary directory, Redis on a real Valkey server, the host tier in shared memory.

A chunk written through the process is read back verified by this process's tiers (and the
headers were made there, not here); a writer killed mid-run degrades to no lower-tier stores
without failing a request or leaking a pinned slot; engine shutdown reaps it, and a writer
whose engine process died exits by itself.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvserve.kv.backends import create_backend
from kvserve.kv.backends.base import ChunkLayout
from kvserve.kv.backends.chunk_format import ChunkCodec
from kvserve.kv.backends.cpu import CpuBackend
from kvserve.kv.backends.storage import TierSpec
from kvserve.kv.offload.storage_worker import ReadItem, StorageResult, StorageWorker
from tests.kv.test_offload_e2e import assert_idle, make_llm, rand_prompt, ref_tokens, run

LAYOUT = ChunkLayout(
    num_layers=2, block_size=16, num_kv_heads=2, head_dim=32, dtype="bfloat16", blocks_per_chunk=2
)
CODEC = ChunkCodec("0123456789abcdef", LAYOUT.describe(), LAYOUT.chunk_bytes)
TIMEOUT = 60.0  # generous: a loaded 2-core CI machine


def gone(pid: int) -> bool:
    """The process ended and was reaped (or is not ours to wait for and ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def wait_results(worker: StorageWorker, n: int) -> list[StorageResult]:
    out: list[StorageResult] = []
    deadline = time.monotonic() + TIMEOUT
    while len(out) < n and time.monotonic() < deadline:
        worker.wait_any(0.5)
        out += worker.poll()
    assert len(out) == n, f"{len(out)} of {n} results in {TIMEOUT} s"
    return out


@pytest.fixture
def host() -> Iterator[CpuBackend]:
    tier = CpuBackend(LAYOUT, 32 * LAYOUT.chunk_bytes, shared=True)
    yield tier
    tier.close()


@pytest.fixture
def process_worker(
    tmp_path: Path, host: CpuBackend, redis_server: Any
) -> Iterator[Callable[..., StorageWorker]]:
    """``make(**kw)``: a storage worker over disk, fs and redis tiers whose writes run in a
    writer process; shut down (tiers closed, writer reaped) at the end."""
    made: list[StorageWorker] = []

    def make(**kw: Any) -> StorageWorker:
        specs = [
            TierSpec("disk", {"path": str(tmp_path / "disk"), "size": "4MiB"}),
            TierSpec("fs", {"path": str(tmp_path / "fs"), "size": "4MiB"}),
            TierSpec("redis", {"url": redis_server.url}),
        ]
        tiers = [create_backend(s.type, CODEC, **s.options) for s in specs]
        w = StorageWorker(tiers, write_process=True, host=host, specs=specs, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()


def fill(host: CpuBackend, slots: list[int], seed: int) -> list[bytes]:
    """Random bytes in these host slots; their chunk keys."""
    rng = random.Random(seed)
    for s in slots:
        host.slots_u8[s].numpy()[:] = list(rng.randbytes(LAYOUT.chunk_bytes))
    return [rng.randbytes(32) for _ in slots]


def test_chunks_written_by_the_process_read_back_verified(
    process_worker, host: CpuBackend, monkeypatch
) -> None:
    """Writes go through the writer process (headers and hashes made there: none here) and
    land in every tier; this process's tiers read them back verified, byte for byte."""
    worker = process_worker()
    assert worker.writer is not None and worker.writer.pid != os.getpid()
    slots = list(range(6))
    keys = fill(host, slots, seed=1)
    made_here: list[bytes] = []
    header = ChunkCodec.header
    monkeypatch.setattr(
        ChunkCodec, "header", lambda self, k, p: made_here.append(k) or header(self, k, p)
    )
    payloads = [memoryview(host.slots_u8[s].numpy()) for s in slots]
    assert worker.write(keys[:4], payloads[:4]) is not None
    assert worker.write(keys[4:], payloads[4:]) is not None
    results = wait_results(worker, 2)
    assert made_here == []  # every header (and its xxh3-128) was made in the writer process
    assert all(r.kind == "write" and all(r.ok) for r in results)
    assert not worker.has_inflight() and worker._pending_write_chunks == 0
    for t, tier in enumerate(worker.tiers):
        assert sorted(k for r in results for k in r.stored[t]) == sorted(keys)
        assert tier.exists(keys) == 6  # the disk tier's index here knows the slots written
        assert tier.stats.written == 6  # the writer's counters, added here
    expected = [bytes(p) for p in payloads]
    for t in range(len(worker.tiers)):
        dest = list(range(8, 14))
        for s in dest:
            host.slots_u8[s].numpy()[:] = 0
        op = worker.read([ReadItem(t, k, memoryview(host.slots_u8[s].numpy()))
                          for k, s in zip(keys, dest, strict=True)])  # fmt: skip
        (res,) = wait_results(worker, 1)
        assert res.op_id == op and res.ok == [True] * 6, worker.tiers[t].name
        assert [bytes(host.slots_u8[s].numpy()) for s in dest] == expected


def test_the_writer_process_runs_under_sched_idle(process_worker, host: CpuBackend) -> None:
    """Every thread of the writer process (its loop, write threads, the fs tier's sweeper) runs
    on cores the engine leaves idle, by default."""
    worker = process_worker()
    keys = fill(host, [0, 1], seed=4)
    assert worker.write(keys, [memoryview(host.slots_u8[s].numpy()) for s in (0, 1)])
    wait_results(worker, 1)  # its write threads started
    pid = worker.writer.pid
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    assert len(tids) >= 3  # main loop, a write thread, the fs sweeper
    assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}


def test_a_payload_outside_host_memory_is_refused(process_worker) -> None:
    """The writer reads chunks from the host tier's shared memory only: other memory is a
    caller's bug, refused without leaving the write queue counted full."""
    worker = process_worker()
    with pytest.raises(ValueError, match="host tier"):
        worker.write([bytes(32)], [memoryview(bytearray(LAYOUT.chunk_bytes))])
    assert worker._pending_write_chunks == 0 and not worker.has_inflight()


def test_pause_holds_the_writer_process(process_worker, host: CpuBackend) -> None:
    worker = process_worker()
    keys = fill(host, [0], seed=2)
    worker.pause_writes()
    worker.write(keys, [memoryview(host.slots_u8[0].numpy())])
    worker.wait_any(0.3)  # bounded pause is 1 s: nothing may finish before
    assert worker.poll() == []
    worker.resume_writes()
    (res,) = wait_results(worker, 1)
    assert all(res.ok)


def test_a_killed_writer_drops_later_writes(process_worker, host: CpuBackend) -> None:
    """In-flight writes fail (their disk slots go back), later ones are dropped and counted."""
    worker = process_worker()
    writer = worker.writer
    assert writer is not None
    keys = fill(host, [0, 1], seed=3)
    os.kill(writer.pid, signal.SIGKILL)
    deadline = time.monotonic() + TIMEOUT
    while writer.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not writer.alive and gone(writer.pid)
    assert worker.write(keys, [memoryview(host.slots_u8[s].numpy()) for s in (0, 1)]) is None
    assert worker.writer_lost_chunks == 2
    assert all(t.stats.dropped == 2 for t in worker.tiers)
    disk = worker.tiers[0]
    assert not disk._writing and disk.usage()[0] == 0


def test_the_writer_process_applies_fs_retention(process_worker, host: CpuBackend) -> None:
    """With a writer process, the fs tier's retention runs there with the writes (a sweep
    lists and stats every file: Python that held the engine process's GIL against the engine
    thread): this process runs no sweeper, yet the namespace stays within its size, and the
    writer's evictions and usage reach this process's counters."""
    worker = process_worker()
    fs = worker.tiers[1]
    assert fs._sweeper is None  # stopped when the writer process took the writes
    slots = list(range(32))
    fill(host, slots, seed=5)
    payloads = [memoryview(host.slots_u8[s].numpy()) for s in slots]
    rng = random.Random(6)
    limit = fs.size_bytes // fs.stored_bytes

    def held() -> int:
        return sum(1 for _, _, files in os.walk(fs.dir) for f in files if f.endswith(".kvc"))

    written = 0
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:  # unique chunks, 1.25x the tier's size at least
        assert worker.write([rng.randbytes(32) for _ in slots], payloads) is not None
        (res,) = wait_results(worker, 1)
        written += sum(res.ok)
        if written > 1.25 * limit and fs.stats.evicted and held() <= limit:
            break
        time.sleep(0.05)  # the writer's sweeper runs between writes
    assert written > 1.25 * limit and fs.stats.evicted > 0, (written, limit, fs.stats)
    assert held() <= limit
    # The writer's usage: what its last sweep left plus what it wrote since (one early sweep
    # is due every sweep_after bytes).
    assert 0 < fs.usage()[0] <= fs.size_bytes + fs.sweep_after + len(slots) * fs.stored_bytes
    assert fs._sweeper is None


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from kvserve import LLM

    llm = LLM(model=str(tiny_model_dir), num_kv_blocks=1024, enable_prefix_caching=False)
    yield llm
    llm.shutdown()


def test_engine_survives_a_killed_writer_and_reaps_it(tiny_model_dir, reference, tmp_path) -> None:
    """An engine whose writer is killed keeps serving right answers; the cascade's chunks are
    dropped (counted), none stays pinned; shutdown reaps a live writer."""
    rng = random.Random(17)
    tier = [f"disk:path={tmp_path / 'disk'},size=0.05", f"fs:path={tmp_path / 'fs'},size=0.05"]
    llm = make_llm(tiny_model_dir, num_kv_blocks=64, kv_tier=tier)
    try:
        writer = llm.engine.connector.storage.writer
        assert writer is not None and writer.alive
        a = rand_prompt(rng, 100)
        (oa,) = run(llm, [a], 3)
        stats = llm.get_stats().connector.tiers
        assert all(row["written"] >= 6 for row in stats.values())  # 100 tokens: 6 chunks
        os.kill(writer.pid, signal.SIGKILL)
        deadline = time.monotonic() + TIMEOUT
        while writer.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not writer.alive
        b = rand_prompt(rng, 100)
        (ob,) = run(llm, [b], 3)  # its chunks reach the host tier, not the storage tiers
        assert [oa.outputs[0].token_ids, ob.outputs[0].token_ids] == ref_tokens(
            reference, [a, b], 3
        )
        after = llm.get_stats().connector.tiers
        assert all(after[k]["written"] == stats[k]["written"] for k in stats)
        assert all(after[k]["dropped"] >= 6 for k in stats)
        assert llm.engine.connector.storage.writer_lost_chunks >= 6
        assert_idle(llm)
    finally:
        llm.shutdown()
    assert gone(writer.pid)

    llm = make_llm(tiny_model_dir, num_kv_blocks=64, kv_tier=tier)
    pid = llm.engine.connector.storage.writer.pid
    assert not gone(pid)
    llm.shutdown()
    assert gone(pid)


def test_writer_exits_when_its_engine_process_dies(tmp_path: Path) -> None:
    """A writer whose engine process was killed (no shutdown) sees its socket close and exits."""
    script = textwrap.dedent(f"""
        import sys, time
        from kvserve.kv.backends import create_backend
        from kvserve.kv.backends.base import ChunkLayout
        from kvserve.kv.backends.chunk_format import ChunkCodec
        from kvserve.kv.backends.cpu import CpuBackend
        from kvserve.kv.backends.storage import TierSpec
        from kvserve.kv.offload.storage_worker import StorageWorker
        layout = ChunkLayout(2, 16, 2, 32, "bfloat16", 2)
        codec = ChunkCodec("0123456789abcdef", layout.describe(), layout.chunk_bytes)
        host = CpuBackend(layout, 4 * layout.chunk_bytes, shared=True)
        spec = TierSpec("fs", {{"path": {str(tmp_path / "fs")!r}, "size": "1MiB"}})
        w = StorageWorker([create_backend("fs", codec, **spec.options)], write_process=True,
                          host=host, specs=[spec])
        print(w.writer.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert not gone(pid)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + TIMEOUT
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)
