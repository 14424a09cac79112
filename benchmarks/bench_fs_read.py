"""The fs tier's staging read from the page cache, its C read vs its Python read: the storage
worker (two page-cache reading threads, groups of contiguous chunks) over one fs tier, in a
process with nothing else in it, or (``--engine``) an engine's own storage worker with the
engine in the process (the ``tiny`` model, a host tier and an fs tier, its writer process).

Per round, interleaved, the order alternating: a plain read of the same files (open / preadv /
close, two threads), the tier's C read (``_fs_read``: a call's files read and hashed without
the GIL) and its Python read (three GIL releases per file), each with this process's main
thread idle (waiting for the result) and busy (pure Python until the result comes, polling
every 2 ms: an engine thread between torch calls at its most GIL-bound, which gives the GIL
up only at the switch interval). Reported: medians and the median of per-round ratios.

``benchmarks/bench_tiers.py`` measurement 3 / 3' run the same reads inside an engine's
process (a model loaded, the writer process, its threads).

Usage: python benchmarks/bench_fs_read.py [--rounds 25] [--chunks 63] [--engine]
Results: benchmarks/results/fs_read.{md,json} (fs_read_engine with --engine).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.progress import track

from kvserve.bench.machine import describe_machine, machine_markdown
from kvserve.kv.backends import create_backend
from kvserve.kv.backends.chunk_format import ChunkCodec
from kvserve.kv.backends.fs import NATIVE_HASH, NATIVE_READ
from kvserve.kv.offload.storage_worker import ReadItem, StorageWorker

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_tiers as tiers  # noqa: E402  (its plain read and its wait for a staging read)

RESULTS = Path(__file__).parent / "results"
CHUNK_BYTES = 768 << 10  # the `small` preset's 64-token chunk


def bare_setup(args) -> tuple:
    """A storage worker over one fs tier holding ``--chunks`` chunks of the ``small`` preset's
    size: (worker, tier, keys, codec, close)."""
    codec = ChunkCodec("0123456789abcdef", "bench-fs-read", payload_bytes=CHUNK_BYTES)
    root = tempfile.mkdtemp(prefix="kvserve-bench-fs-read-", dir="/var/tmp")
    tier = create_backend("fs", codec, path=root, size="2GiB", sweep=False)
    worker = StorageWorker([tier], io_threads=4)
    keys = [os.urandom(32) for _ in range(args.chunks)]
    payload = memoryview(mmap.mmap(-1, CHUNK_BYTES))
    payload[:] = os.urandom(CHUNK_BYTES)
    assert tier.put(keys, [payload] * len(keys)) == [True] * len(keys)

    def close() -> None:
        worker.shutdown()
        tier.close()
        shutil.rmtree(root, ignore_errors=True)

    return worker, tier, keys, codec, close


def engine_setup(args) -> tuple:
    """An engine (the ``tiny`` model, made here) with a host tier and an fs tier, after one
    prompt of ``--engine-prompt`` tokens: its own storage worker (writer process included)
    and the prompt's chunks in the fs tier."""
    from kvserve.engine.llm import LLM
    from kvserve.engine.sampling_params import SamplingParams
    from kvserve.model.presets import make_model

    tmp = tempfile.mkdtemp(prefix="kvserve-bench-fs-read-", dir="/var/tmp")
    model = make_model(Path(tmp) / "model", preset="tiny")
    llm = LLM(
        model=str(model),
        kv_offload_size=0.25,
        kv_offload_block_size=64,
        kv_tier=[f"fs:path={tmp}/fs,size=1GiB"],
    )
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(args.engine_prompt)]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    conn = llm.engine.connector
    keys = list(conn.manager._entries)
    tier = conn.tiers[0]
    deadline = time.monotonic() + 30
    while tier.exists(keys) < len(keys):  # the cascade's writes land
        assert time.monotonic() < deadline, "the fs tier did not get the prompt's chunks"
        time.sleep(0.05)

    def close() -> None:
        llm.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    return conn.storage, tier, keys, tier.codec, close


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--chunks", type=int, default=63, help="a 4000-token prompt of `small`")
    ap.add_argument(
        "--engine",
        action="store_true",
        help="read through an engine's own storage worker, the engine in this process",
    )
    ap.add_argument("--engine-prompt", type=int, default=2000, help="tokens (--engine)")
    ap.add_argument("--out", default=None, help="results basename (fs_read, fs_read_engine)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.out = args.out or ("fs_read_engine" if args.engine else "fs_read")
    if not NATIVE_READ:
        raise SystemExit("the C extension _fs_read was not built (pip install -e .)")

    setup = engine_setup if args.engine else bare_setup
    worker, tier, keys, codec, close = setup(args)
    n = len(keys)
    stored = codec.stored_bytes

    def tier_read(dest: memoryview, native: bool, busy: bool) -> float:
        tier.native_read = native
        worker.read(
            [ReadItem(0, k, dest[i * stored : i * stored + codec.payload_bytes])
             for i, k in enumerate(keys)]
        )  # fmt: skip
        r = tiers.await_result(worker, busy)
        assert all(r.ok)
        return r.nbytes / r.seconds / 1e9

    threads = worker.cached_read_threads
    kinds = {  # the plain read: bench_tiers' (open / preadv / close, the tier's threads)
        "plain": lambda d: tiers.raw_read(tier, keys, threads, 1, d) / 1e9,
        "c": lambda d: tier_read(d, True, False),
        "python": lambda d: tier_read(d, False, False),
        "c_busy": lambda d: tier_read(d, True, True),
        "python_busy": lambda d: tier_read(d, False, True),
    }
    # Page-aligned, faulted in once, reused every round: each kind's own.
    outs = {k: memoryview(tiers._destination(n * stored)) for k in kinds}
    for k, f in kinds.items():  # warm: files cached, threads started
        f(outs[k])
    rows: dict[str, list[float]] = {k: [] for k in kinds}
    order = list(kinds)
    for r in track(range(args.rounds), description="fs reads"):
        for k in order if r % 2 == 0 else order[::-1]:
            rows[k].append(kinds[k](outs[k]))
    close()

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rows[a], rows[b], strict=True))

    med = {k: statistics.median(v) for k, v in rows.items()}
    res = {
        "machine": describe_machine(),
        "args": {k: v for k, v in vars(args).items() if k != "results_dir"},
        "native_hash": NATIVE_HASH,
        "chunks": n,
        "chunk_bytes": codec.payload_bytes,
        "cached_read_threads": threads,
        "GB_s": rows,
        "median_GB_s": med,
        "c_over_plain": ratio("c", "plain"),
        "python_over_plain": ratio("python", "plain"),
        "c_over_python": ratio("c", "python"),
        "busy_c_over_python": ratio("c_busy", "python_busy"),
    }
    md = report(res)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{args.out}.json").write_text(json.dumps(res, indent=1, default=str))
    (args.results_dir / f"{args.out}.md").write_text(md)
    print(md)
    return res


def report(res: dict) -> str:
    m = res["median_GB_s"]
    return (
        "# The fs tier's read from the page cache: C vs Python, "
        + ("through an engine's storage worker\n\n" if res["args"]["engine"] else "no engine\n\n")
        + machine_markdown(res["machine"])
        + f"\nCommand: `python benchmarks/bench_fs_read.py`; args: `{json.dumps(res['args'])}`; "
        f"{res['cached_read_threads']} reading threads; {res['chunks']} chunks of "
        f"{res['chunk_bytes'] >> 10} KiB\n\n"
        "| read | main thread idle: GB/s | / plain read | main thread in Python: GB/s |\n"
        "| --- | --- | --- | --- |\n"
        f"| plain (open / preadv / close) | {m['plain']:.2f} | 1 | - |\n"
        f"| tier, C read | {m['c']:.2f} | {res['c_over_plain']:.2f} | {m['c_busy']:.2f} |\n"
        f"| tier, Python read | {m['python']:.2f} | {res['python_over_plain']:.2f} | "
        f"{m['python_busy']:.2f} |\n\n"
        f"C read / Python read, median of per-round ratios: idle {res['c_over_python']:.2f}x, "
        f"main thread in Python {res['busy_c_over_python']:.1f}x.\n"
    )


if __name__ == "__main__":
    main()
