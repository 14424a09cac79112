"""What a guest's writes to its virtual disk cost in the hypervisor's steal time: the probe behind
the README's account of issue 11's goal 4 (decode while the tiers absorb a write stream).

A spinner process on vCPU 0 counts iterations of a pure-Python loop; on vCPU 1 this process
runs, per round and in a rotating order, arms of ``--arm-s`` seconds each: ``idle`` (sleeps),
``write`` (1 MiB ``pwrite`` calls with O_DIRECT into a file under ``--dir``, paced to
``--mb-s``) and ``memcpy`` (1 MiB copies paced the same: a vCPU as busy, no I/O). Per arm:
each vCPU's steal time (``/proc/stat``: the host running something else while the vCPU
wanted to run) per second and the spinner's rate over its rate in the round's idle arm.
Steal of the writing vCPU in ``write`` over ``memcpy`` is the host's work for the writes that
competes with the guest's own vCPUs.

Usage: python benchmarks/bench_write_steal.py [--rounds 10] [--mb-s 200] [--dir /var/tmp]
Results: benchmarks/results/write_steal.{md,json}
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.progress import track

from kvserve.bench.machine import describe_machine, machine_markdown

RESULTS = Path(__file__).parent / "results"
BLOCK = 1 << 20
FILE_BLOCKS = 256
ARMS = ("idle", "write", "memcpy")


def steal_s() -> list[float]:
    """Each vCPU's steal time so far, in seconds (the 8th value of its ``/proc/stat`` line)."""
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        return [
            int(line.split()[8]) / hz for line in f if line.startswith("cpu") and line[3].isdigit()
        ]


def spin(counter: ctypes.c_longlong, stop: ctypes.c_byte) -> None:
    """The spinner on vCPU 0: iterations of a pure-Python loop, published every 10,000."""
    os.sched_setaffinity(0, {0})
    n = 0
    while not stop.value:
        for _ in range(10_000):
            n += 1
        counter.value = n


def run_arm(arm: str, seconds: float, mb_s: float, fd: int, src: mmap.mmap, dst: bytearray) -> int:
    """One arm on this process's vCPU; returns the MiB it moved."""
    t0 = time.perf_counter()
    end, i = t0 + seconds, 0
    while (now := time.perf_counter()) < end:
        if arm == "idle":
            time.sleep(min(0.01, end - now))
            continue
        if arm == "write":
            os.pwrite(fd, src, (i % FILE_BLOCKS) * BLOCK)
        else:
            dst[:] = src
        i += 1
        if (lag := t0 + i / mb_s - time.perf_counter()) > 0:
            time.sleep(lag)
    return i


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--arm-s", type=float, default=2.0)
    ap.add_argument("--mb-s", type=float, default=200.0, help="pace of write and memcpy, MiB/s")
    ap.add_argument("--dir", default="/var/tmp", help="where the written file lives")
    ap.add_argument("--out", default="write_steal")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not {0, 1} <= os.sched_getaffinity(0):
        raise SystemExit("needs vCPUs 0 and 1")

    os.sched_setaffinity(0, {1})
    src = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT requires
    src.write(os.urandom(BLOCK))
    dst = bytearray(BLOCK)
    fd_, path = tempfile.mkstemp(prefix="kvserve-write-steal-", dir=args.dir)
    os.close(fd_)
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    counter, stop = mp.Value("q", 0, lock=False), mp.Value("b", 0, lock=False)  # shared ctypes
    spinner = mp.Process(target=spin, args=(counter, stop), daemon=True)
    spinner.start()
    time.sleep(0.5)
    rows: dict[str, list[dict]] = {a: [] for a in ARMS}
    try:
        for r in track(range(args.rounds), description="rounds"):
            got = {}
            for arm in ARMS[r % 3 :] + ARMS[: r % 3]:
                c0, s0, t0 = counter.value, steal_s(), time.perf_counter()
                mib = run_arm(arm, args.arm_s, args.mb_s, fd, src, dst)
                c1, s1, t1 = counter.value, steal_s(), time.perf_counter()
                got[arm] = {
                    "spin": (c1 - c0) / (t1 - t0),
                    "steal_spinner": (s1[0] - s0[0]) / (t1 - t0),
                    "steal_arm": (s1[1] - s0[1]) / (t1 - t0),
                    "MiB_s": mib / (t1 - t0),
                }
            for arm in ARMS:
                got[arm]["spin_vs_idle"] = got[arm]["spin"] / got["idle"]["spin"]
                rows[arm].append(got[arm])
    finally:
        stop.value = 1
        spinner.join()
        os.close(fd)
        os.unlink(path)

    med = {a: {k: statistics.median(x[k] for x in v) for k in v[0]} for a, v in rows.items()}
    extra = statistics.median(
        w["steal_arm"] - m["steal_arm"] for w, m in zip(rows["write"], rows["memcpy"], strict=True)
    )
    res = {
        "machine": describe_machine(),
        "args": {k: v for k, v in vars(args).items() if k != "results_dir"},
        "rows": rows,
        "median": med,
        "write_minus_memcpy_steal": extra,
    }
    md = report(res)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{args.out}.json").write_text(json.dumps(res, indent=1))
    (args.results_dir / f"{args.out}.md").write_text(md)
    print(md)
    return res


def report(res: dict) -> str:
    a, m = res["args"], res["median"]
    lines = [
        "# The hypervisor's steal time under a guest's disk writes\n",
        machine_markdown(res["machine"]),
        f"\nCommand: `python benchmarks/bench_write_steal.py`; args: `{json.dumps(a)}`\n",
        f"Medians over {a['rounds']} rounds of {a['arm_s']} s per arm (order rotating). "
        "Steal in vCPUs (seconds per second).\n",
        "| arm (on vCPU 1) | MiB/s | steal, vCPU 1 | steal, vCPU 0 (spinner) "
        "| spinner rate / idle arm's |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for arm in ARMS:
        x = m[arm]
        lines.append(
            f"| {arm} | {x['MiB_s']:.0f} | {x['steal_arm']:.3f} | {x['steal_spinner']:.3f} "
            f"| {x['spin_vs_idle']:.3f} |"
        )
    lines.append(
        f"\nThe writing vCPU's steal, write minus memcpy per round (median): "
        f"{res['write_minus_memcpy_steal']:+.3f} of a vCPU at {a['mb_s']:.0f} MiB/s.\n"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
