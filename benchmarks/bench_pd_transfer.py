"""P/D KV transfer bandwidth vs loopback TCP for the same bytes, measured in the same run.

1. transport path: the producer's block server and the consumer's puller (their threads, as an
   engine runs them) on KV pools of the preset's block layout; each pull (a lease of N MiB of
   blocks: connect, request, header, bytes straight into the destination blocks, per-block
   xxh3 verification, done, lease released) is followed by a plain loopback transfer of the
   same bytes (fresh connection, one ``sendall`` of a buffer, ``recv_into`` another). Blocks
   consecutive on both sides (what an idle engine allocates) or scattered (random block ids on
   both sides: one ``sendall`` / ``recv_into`` per block, the worst case). Medians over
   ``--reps`` pairs and the median of the paired ratios.
2. engine end to end: a producer engine and a consumer engine (one process, real sockets):
   long prompts prefilled on the producer, decode leg (``max_tokens=1``) on the consumer; the
   bandwidth of each pull (bytes of blocks pulled / the pull's time from connect to verified)
   vs a plain loopback transfer of the same bytes right after it. On each preset of
   ``--engine-presets`` (``tiny``: 2k-token prompts, 8 MiB; ``small``: 4k tokens, 96 MiB in fp32).

Goal: transfer bandwidth / loopback bandwidth >= 0.7.

Usage: python benchmarks/bench_pd_transfer.py [--preset tiny|small] [--engine-presets tiny small]
Results: benchmarks/results/pd_transfer.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.bench.machine import describe_machine, machine_markdown
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.pd.block_memory import BlockMemory
from kvserve.kv.pd.leases import LeaseTable
from kvserve.kv.pd.transfer_client import TcpPuller
from kvserve.kv.pd.transfer_server import TcpBlockServer
from kvserve.kv.pd.transport import PullJob
from kvserve.model.presets import make_model

RESULTS = Path(__file__).parent / "results"


class Loopback:
    """A plain TCP transfer of ``nbytes`` over loopback: the baseline (same process, a server
    thread sending, this thread receiving, as the block server and the puller do)."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        self.dst = np.empty(nbytes, dtype=np.uint8)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)

    def transfer(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` (connect to last byte received)."""

        def serve() -> None:
            conn, _ = self.listener.accept()
            with conn:
                conn.sendall(memoryview(self.src)[:nbytes])

        t = threading.Thread(target=serve)
        t.start()
        t0 = time.perf_counter()
        with socket.create_connection(self.listener.getsockname()) as s:
            view = memoryview(self.dst)[:nbytes]
            got = 0
            while got < nbytes:
                got += s.recv_into(view[got:], nbytes - got)
        dt = time.perf_counter() - t0
        t.join()
        return dt

    def close(self) -> None:
        self.listener.close()


def pd_leases(engine: LLMEngine) -> LeaseTable:
    leases = engine.connector.leases
    assert leases is not None
    return leases


def block_shape(model: str) -> tuple[tuple[int, ...], torch.dtype]:
    eng = LLMEngine(EngineConfig(model=model, num_kv_blocks=4))
    shape, dtype = tuple(eng.kv_cache.shape[1:]), eng.kv_cache.dtype
    eng.shutdown()
    return shape, dtype


def bench_transport(model: str, args, scattered: bool) -> dict:
    shape, dtype = block_shape(model)
    block_bytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    n = max(1, int(args.pull_mib * (1 << 20)) // block_bytes)
    num_blocks = n * 2 + 1
    src = torch.randn((num_blocks, *shape)).to(dtype)
    dst = torch.zeros((num_blocks, *shape), dtype=dtype)
    leases = LeaseTable(timeout=600.0)
    server = TcpBlockServer(BlockMemory(src), leases, "fp", timeout=30.0)
    puller = TcpPuller(BlockMemory(dst), "fp", timeout=30.0)
    loop = Loopback(n * block_bytes)
    rng = random.Random(1)
    pulls, raws, ratios = [], [], []
    try:
        for rep in range(args.reps + 1):  # the first pair warms up
            if scattered:
                src_ids = rng.sample(range(1, num_blocks), n)
                dst_ids = rng.sample(range(1, num_blocks), n)
            else:
                src_ids = list(range(1, n + 1))
                dst_ids = list(range(n + 1, 2 * n + 1))
            lease = leases.add("r", src_ids, [b"h" * 32] * n)
            server.seal(lease)
            lease.sealed.wait(60)  # sealing is the producer's, right after its prefill
            host, port = server.address
            job = PullJob(rep, "r", host, port, lease.lease_id, 0, n, dst_ids, [b"h" * 32] * n)
            raw_first = rep % 2 == 1  # alternate the order: drift hits both sides alike
            if raw_first:
                raw = loop.transfer(n * block_bytes)
            puller.submit(job)
            while not puller.poll():
                puller.wakeup.wait(0.01)
                puller.wakeup.clear()
            assert job.good_blocks == n, job.error
            deadline = time.monotonic() + 10
            while not leases.take_released():  # the server thread ends the lease last
                assert time.monotonic() < deadline
                time.sleep(0.0005)
            if not raw_first:
                raw = loop.transfer(n * block_bytes)
            if rep == 0:
                continue
            pulls.append(job.seconds)
            raws.append(raw)
            ratios.append(raw / job.seconds)
        # Spot-check the bytes of the last pull.
        for s, d in zip(src_ids[:8], dst_ids[:8], strict=True):
            assert torch.equal(src[s], dst[d])
    finally:
        loop.close()
        puller.close()
        server.close()
    nbytes = n * block_bytes
    return {
        "blocks": n,
        "block_bytes": block_bytes,
        "bytes": nbytes,
        "scattered": scattered,
        "pull_s": pulls,
        "loopback_s": raws,
        "pull_GB_s": nbytes / statistics.median(pulls) / 1e9,
        "loopback_GB_s": nbytes / statistics.median(raws) / 1e9,
        "ratio_of_medians": statistics.median(raws) / statistics.median(pulls),
        "paired_ratio_median": statistics.median(ratios),
        "paired_ratios": ratios,
    }


def bench_engines(model: str, args) -> dict:
    """Pulls between real engines: bytes / pull time vs a loopback transfer right after."""
    kw = dict(model=model, num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=4096)
    producer = LLMEngine(EngineConfig(kv_role="producer", **kw))
    consumer = LLMEngine(EngineConfig(kv_role="consumer", **kw))
    vocab = producer.runner.model_config.vocab_size
    block_bytes = consumer.runner.kv_block_bytes()
    rng = random.Random(2)
    plen = producer.max_model_len - 8  # the longest prompt the model takes
    loop = Loopback((plen // 16 + 1) * block_bytes)
    rows = []

    def finish(eng: LLMEngine, rid: str):
        while True:
            for out in eng.step():
                if out.request_id == rid and out.finished:
                    return out

    try:
        for i in range(args.engine_prompts + 1):  # the first warms up
            prompt = [rng.randrange(10, vocab - 1) for _ in range(plen)]
            sp = SamplingParams(max_tokens=1, temperature=0.0)
            rid = producer.add_request(
                None, prompt, sp, kv_transfer_params={"do_remote_decode": True}
            )
            params = finish(producer, rid).kv_transfer_params
            # The decode leg reaches the consumer after the prefill response went through a
            # proxy (two HTTP hops): the lease is sealed by then. Waiting here keeps the
            # sealing (timed separately) out of the transfer's time.
            t_seal = time.perf_counter()
            lease = pd_leases(producer).get(params["remote_request_id"])
            assert lease is not None and lease.sealed.wait(60)
            seal_s = time.perf_counter() - t_seal
            raw_first = i % 2 == 1  # alternate the order: drift hits both sides alike
            nbytes = len(params["remote_block_ids"]) * block_bytes
            if raw_first:
                raw = loop.transfer(nbytes)
            st0 = consumer.get_stats().connector
            rid = consumer.add_request(None, prompt, sp, kv_transfer_params=params)
            out = finish(consumer, rid)
            st1 = consumer.get_stats().connector
            secs = st1.load_time_s - st0.load_time_s
            assert st1.load_bytes - st0.load_bytes == nbytes
            assert out.metrics.num_external_cached_tokens > 0
            while producer.has_unfinished_requests():  # the lease's release
                producer.step()
            if not raw_first:
                raw = loop.transfer(nbytes)
            if i == 0:
                continue
            rows.append({"bytes": nbytes, "pull_s": secs, "loopback_s": raw, "ratio": raw / secs,
                         "seal_wait_s": seal_s})  # fmt: skip
    finally:
        loop.close()
        producer.shutdown()
        consumer.shutdown()
    return {
        "preset": args.engine_preset,
        "prompt_tokens": plen,
        "block_bytes": block_bytes,
        "rows": rows,
        "pull_GB_s": statistics.median(r["bytes"] / r["pull_s"] for r in rows) / 1e9,
        "loopback_GB_s": statistics.median(r["bytes"] / r["loopback_s"] for r in rows) / 1e9,
        "paired_ratio_median": statistics.median(r["ratio"] for r in rows),
        "seal_wait_ms_median": statistics.median(r["seal_wait_s"] for r in rows) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--pull-mib", type=float, nargs="+", default=[8, 64])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--engine-prompts", type=int, default=25)
    ap.add_argument("--engine-presets", nargs="*", default=["tiny", "small"])
    ap.add_argument("--num-kv-blocks", type=int, default=600)
    ap.add_argument("--out", default="pd_transfer")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="kvserve-bench-pd-")
    model = str(make_model(Path(tmp) / args.preset, preset=args.preset))
    res: dict = {"preset": args.preset, "machine": describe_machine(), "args": vars(args)}
    res["transport"] = []
    for mib in args.pull_mib:
        for scattered in (False, True):
            a = argparse.Namespace(**{**vars(args), "pull_mib": mib})
            r = bench_transport(model, a, scattered)
            res["transport"].append(r)
            print(
                f"transport {mib:g} MiB {'scattered' if scattered else 'consecutive'}: "
                f"{r['pull_GB_s']:.2f} GB/s vs loopback {r['loopback_GB_s']:.2f} GB/s, "
                f"paired ratio {r['paired_ratio_median']:.2f}"
            )
    res["engines"] = []
    for preset in args.engine_presets:
        m = model if preset == args.preset else str(make_model(Path(tmp) / preset, preset=preset))
        e = bench_engines(m, argparse.Namespace(**{**vars(args), "engine_preset": preset}))
        res["engines"].append(e)
        print(
            f"engines, {preset} ({e['prompt_tokens']}-token prompts): {e['pull_GB_s']:.2f} GB/s "
            f"vs loopback {e['loopback_GB_s']:.2f} GB/s, paired ratio "
            f"{e['paired_ratio_median']:.2f} (sealing wait {e['seal_wait_ms_median']:.2f} ms)"
        )
    res["machine"]["loadavg_1m_end"] = describe_machine()["loadavg_1m"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = RESULTS / args.out
    base.with_suffix(".json").write_text(json.dumps(res, indent=2))
    base.with_suffix(".md").write_text(report(res))
    print(f"wrote {base}.{{json,md}}")


def report(res: dict) -> str:
    a = res["args"]
    lines = [
        f"# P/D KV transfer bandwidth vs loopback TCP — `{res['preset']}` preset",
        "",
        machine_markdown(res["machine"]).rstrip(),
        f"- Load average (1 min) at the end: {res['machine'].get('loadavg_1m_end')}",
        "",
        f"Command: `python benchmarks/bench_pd_transfer.py --preset {res['preset']}`; args: "
        f"`{json.dumps(a)}`",
        "",
        "Both sides of every measurement run in this one process on loopback; a pull's time runs "
        "from connect to its blocks verified (header, per-block xxh3, done message and lease "
        "release included); the loopback baseline moves the same bytes over a fresh plain TCP "
        "connection (`sendall` / `recv_into`) right after each pull. Ratio = loopback time / "
        "pull time (>= 0.7 is the goal). Engine to engine, the decode leg starts once the "
        "producer sealed its lease (digests of its blocks, right after the prefill; behind a "
        "proxy the prefill response's two HTTP hops take longer): the median wait for it is "
        "listed. The machine is shared with other jobs: single pairs are noisy, so many pairs "
        "in alternating order and their median.",
        "",
        "| measurement | bytes per pull | pull GB/s (median) | loopback GB/s (median) | "
        "median paired ratio | goal |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["transport"]:
        kind = "scattered blocks" if r["scattered"] else "consecutive blocks"
        lines.append(
            f"| 1. transport path, {kind} ({r['blocks']} x {r['block_bytes'] // 1024} KiB) | "
            f"{r['bytes'] / (1 << 20):.0f} MiB | {r['pull_GB_s']:.2f} | {r['loopback_GB_s']:.2f} | "
            f"{r['paired_ratio_median']:.2f} (pairs: "
            + ", ".join(f"{x:.2f}" for x in r["paired_ratios"])
            + ") | >= 0.7 |"
        )
    for e in res["engines"]:
        lines.append(
            f"| 2. engine to engine, `{e['preset']}`, {e['prompt_tokens']}-token prompts "
            f"(sealing wait {e['seal_wait_ms_median']:.2f} ms) | "
            f"{e['rows'][0]['bytes'] / (1 << 20):.1f} MiB | {e['pull_GB_s']:.2f} | "
            f"{e['loopback_GB_s']:.2f} | {e['paired_ratio_median']:.2f} (pairs: "
            + ", ".join(f"{r['ratio']:.2f}" for r in e["rows"])
            + ") | >= 0.7 |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
