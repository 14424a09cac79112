"""Prefill/decode disaggregation: inter-token latency and TTFT, split vs co-located.

Issue 12's benchmarks 1 and 3 (2, the KV transfer bandwidth, is ``bench_pd_transfer``'s).

1. ``real``: two real ``kvserve serve`` engines (``small`` preset, ``--num-threads 1``, each
   pinned to its own core with ``taskset``) behind ``kvserve route``, one mixed workload: a
   closed loop of short requests that keep ``--short-concurrency`` streams decoding, and
   long-prompt requests arriving (Poisson) among them. Two setups, the same engines and
   router: ``co-located`` (both engines serve whole requests; P/D off) and ``1P1D`` (one
   prefill engine, ``--kv-role producer``; one decode engine, ``--kv-role consumer``;
   ``pd.threshold`` between the short and the long prompts). Reported: ITL p99 (and p90,
   p99.9, of every streamed token gap; the short requests' alone), TTFT p90 of all, short and
   long requests. Setups interleaved, ``--reps`` runs each, medians. Goal: ITL p99 >= 2x
   better with disaggregation, TTFT cost reported as it is.
3. ``sim``: 16 simulated H100 instances (``kvserve sim``, latency model ``h100-llama8b``; KV
   pulls modelled from a 50 GB/s link per instance, ``kvserve/sim/pd.py``) behind the real
   router: all co-located vs xPyD splits (``--num-prefill-instances``), the threshold swept,
   two workloads (prefill-heavy: long documents; decode-heavy: many long answers, a few long
   prompts). The ITL p99 / TTFT p90 frontier is plotted per workload. Latencies are in
   modelled seconds (wall / time scale).

Results: ``benchmarks/results/pd.{md,json,png}`` (a part run alone keeps the other's recorded
results).

    .venv/bin/python benchmarks/bench_pd.py                   # both parts (~1 hour on 2 cores)
    .venv/bin/python benchmarks/bench_pd.py --parts real      # ~15 minutes
    .venv/bin/python benchmarks/bench_pd.py --parts sim --quick
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import yaml

from kvserve.bench.loadgen import LoadConfig, new_record, send_request, wait_for_server
from kvserve.bench.local_cluster import free_port
from kvserve.bench.machine import describe_machine, machine_markdown
from kvserve.bench.records import RequestRecord
from kvserve.bench.workloads import TurnRequest, Vocab

RESULTS = Path(__file__).resolve().parent / "results"
PY = sys.executable


# ---------------------------------------------------------------------------------------------
# The mixed workload


@dataclass
class MixedWorkload:
    """Short requests in a closed loop (``short_concurrency`` streams decoding at all times)
    and long-prompt requests arriving at ``long_rate`` per second (Poisson), for ``duration``
    seconds (modelled seconds in the simulator; users start within the first 2 s). Prompts
    are random token ids: nothing is shared, so every prompt is uncached wherever it goes."""

    name: str
    short_concurrency: int
    short_prompt: int
    short_output: int
    long_rate: float
    long_prompt: int
    long_output: int
    duration: float
    spread: float = 0.0  # prompt lengths uniform in [(1 - spread) x, (1 + spread) x]

    def prompt_len(self, rng: random.Random, mean: int) -> int:
        s = self.spread
        return max(1, rng.randint(int(mean * (1 - s)), int(mean * (1 + s))))

    def long_arrivals(self, seed: int) -> list[float]:
        rng = random.Random(f"long:{self.name}:{seed}")
        out, t = [], rng.expovariate(self.long_rate)
        while t < self.duration:
            out.append(t)
            t += rng.expovariate(self.long_rate)
        return out


async def drive(
    url: str, model: str, w: MixedWorkload, vocab: Vocab, scale: float = 1.0, seed: int = 0
) -> list[tuple[str, RequestRecord]]:
    """Run ``w`` against ``url`` (``scale``: wall seconds per workload second); returns
    (kind, record) of every request, its times in wall seconds."""
    cfg = LoadConfig(base_url=url, model=model, timeout=3600, progress=False)
    rng = random.Random(f"prompts:{w.name}:{seed}")
    out: list[tuple[str, RequestRecord]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(3600, connect=60), limits=limits, trust_env=False
    ) as client:
        t0 = time.perf_counter()
        end = t0 + w.duration * scale

        async def one(kind: str, sid: str, mean_len: int, output_len: int) -> None:
            prompt = vocab.sample(rng, w.prompt_len(rng, mean_len))
            req = TurnRequest(sid, 0, output_len, 0.0, prompt=prompt)
            rec = new_record(req, sid)
            await send_request(client, cfg, req, rec, t0)
            out.append((kind, rec))

        async def short_user(i: int) -> None:
            # Staggered starts: the users' requests do not begin (and end) in lockstep.
            await asyncio.sleep(i * 2.0 / w.short_concurrency * scale)
            n = 0
            while time.perf_counter() < end:
                await one("short", f"short-{i}-{n}", w.short_prompt, w.short_output)
                n += 1

        async def long_request(k: int, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at * scale - time.perf_counter()))
            await one("long", f"long-{k}", w.long_prompt, w.long_output)

        await asyncio.gather(
            *(short_user(i) for i in range(w.short_concurrency)),
            *(long_request(k, at) for k, at in enumerate(w.long_arrivals(seed))),
        )
    return out


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values), q)) if values else None


def measure(records: list[tuple[str, RequestRecord]], scale: float = 1.0) -> dict:
    """Latencies (seconds, divided by ``scale``) of one run."""
    ok = [(k, r) for k, r in records if r.ok]
    itl = [x / scale for _, r in ok for x in r.itl]
    itl_short = [x / scale for k, r in ok if k == "short" for x in r.itl]
    ttft = {
        kind: [r.ttft / scale for k, r in ok if r.ttft is not None and (kind == "all" or k == kind)]
        for kind in ("all", "short", "long")
    }
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for _, r in records if r.error})[:5],
        "long_requests": sum(k == "long" for k, _ in ok),
        "output_tokens": sum(r.output_tokens for _, r in ok),
        "itl_p50": pct(itl, 50),
        "itl_p90": pct(itl, 90),
        "itl_p99": pct(itl, 99),
        "itl_p999": pct(itl, 99.9),
        "itl_max": max(itl) if itl else None,
        "itl_short_p99": pct(itl_short, 99),
        "ttft_p50": pct(ttft["all"], 50),
        "ttft_p90": pct(ttft["all"], 90),
        "ttft_short_p90": pct(ttft["short"], 90),
        "ttft_long_p50": pct(ttft["long"], 50),
        "ttft_long_p90": pct(ttft["long"], 90),
        "endpoints": dict(
            sorted(
                {
                    f"{k}@{r.endpoint}": sum(
                        1 for k2, r2 in ok if (k2, r2.endpoint) == (k, r.endpoint)
                    )
                    for k, r in ok
                }.items()
            )
        ),
    }


# ---------------------------------------------------------------------------------------------
# Processes


class Procs:
    """Child processes, each in its own process group; all stopped on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the proc
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for k in ("KVSERVE_API_KEY", "VLLM_API_KEY", "KVSERVE_UPSTREAM_API_KEY"):
            env.pop(k, None)
        p = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.procs.append(p)
        return p

    def stop_all(self, timeout: float = 20.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []


def start_router(procs: Procs, name: str, cfg: dict, n_endpoints: int) -> str:
    port = free_port()
    cfg = {"host": "127.0.0.1", "port": port, "log_level": "warning", **cfg}
    path = procs.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    p = procs.start(name, [PY, "-m", "kvserve.cli", "route", "--config", str(path)])
    url = f"http://127.0.0.1:{port}"
    wait_for_server(url, timeout=120, proc=p)
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=10, trust_env=False) as c:
        while c.get(url + "/health").json().get("healthy_endpoints", 0) < n_endpoints:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: endpoints not healthy")
            time.sleep(0.2)
    time.sleep(1.0)  # KV event subscriptions connect
    return url


def router_pd_counts(url: str) -> dict:
    """The router's P/D decisions and fallbacks (/metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvserve_router_pd_decisions_total":
                out[f"{s.labels['disaggregated']}:{s.labels['reason']}"] = s.value
            elif s.name == "kvserve_router_pd_fallbacks_total":
                out[f"fallback:{s.labels['error']}"] = s.value
            elif s.name == "kvserve_router_pd_prefill_seconds_sum":
                out["prefill_leg_seconds_sum"] = out.get("prefill_leg_seconds_sum", 0) + s.value
            elif s.name == "kvserve_router_pd_prefill_seconds_count":
                out["prefill_legs"] = out.get("prefill_legs", 0) + s.value
    return out


# ---------------------------------------------------------------------------------------------
# 1. Real engines


def real_workload(args) -> MixedWorkload:
    return MixedWorkload(
        "real-mixed",
        short_concurrency=args.short_concurrency,
        short_prompt=args.short_prompt,
        short_output=args.short_output,
        long_rate=args.long_rate,
        long_prompt=args.long_prompt,
        long_output=args.long_output,
        duration=args.duration,
    )


def run_real(setup: str, args, w: MixedWorkload, vocab: Vocab, rep: int, log_root: Path) -> dict:
    log_dir = log_root / f"{setup}-{rep}"
    log_dir.mkdir(parents=True)
    procs = Procs(log_dir)
    roles = {"co-located": (None, None), "1P1D": ("producer", "consumer")}[setup]
    try:
        endpoints = []
        for i, role in enumerate(roles):
            port, ev, rp = free_port(), free_port(), free_port()
            argv = [
                "taskset", "-c", str(i % (os.cpu_count() or 1)),
                PY, "-m", "kvserve.cli", "serve",
                "--model", args.model_dir, "--served-model-name", "small",
                "--port", str(port), "--num-threads", "1",
                "--num-kv-blocks", str(args.num_kv_blocks),
                "--max-num-seqs", "64",
                "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--kv-events-endpoint", f"tcp://127.0.0.1:{ev}",
                "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rp}",
                *(["--kv-role", role] if role else []),
            ]  # fmt: skip
            p = procs.start(f"engine{i}", argv)
            url = f"http://127.0.0.1:{port}"
            wait_for_server(url, timeout=300, proc=p)
            endpoints.append(
                {
                    "url": url,
                    "name": f"engine{i}",
                    "kv_events": f"tcp://127.0.0.1:{ev}",
                    "kv_events_replay": f"tcp://127.0.0.1:{rp}",
                    "role": {None: "both", "producer": "prefill", "consumer": "decode"}[role],
                }
            )
        cfg: dict = {"endpoints": endpoints, "tokenizer": args.model_dir}
        if setup != "co-located":
            cfg["pd"] = {"threshold": args.threshold}
        url = start_router(procs, f"router-{setup}", cfg, len(endpoints))
        # Warm-up (not measured): the first requests pay torch's and the allocator's start.
        warm = dataclasses.replace(w, duration=4.0, long_rate=0.5, name="warm")
        asyncio.run(drive(url, "small", warm, vocab, seed=10_000 + rep))
        before = router_pd_counts(url)
        t0 = time.monotonic()
        records = asyncio.run(drive(url, "small", w, vocab, seed=rep))
        wall = time.monotonic() - t0
        after = router_pd_counts(url)
    finally:
        procs.stop_all()
    m = measure(records)
    m.update(
        setup=setup,
        rep=rep,
        wall_s=round(wall, 1),
        loadavg_1m=os.getloadavg()[0],
        router_pd={k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)},
    )
    return m


def real_part(args, vocab: Vocab) -> dict:
    w = real_workload(args)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-pd-") as tmp:
        for rep in range(args.reps):
            for setup in ("co-located", "1P1D"):
                t0 = time.monotonic()
                m = run_real(setup, args, w, vocab, rep, Path(tmp))
                print(
                    f"[real] {setup:>10} rep {rep}: ITL p99 {m['itl_p99'] * 1e3:.0f} ms "
                    f"(p90 {m['itl_p90'] * 1e3:.0f}, p99.9 {m['itl_p999'] * 1e3:.0f}), TTFT p90 "
                    f"{m['ttft_p90']:.2f} s (short {m['ttft_short_p90']:.2f}, long "
                    f"{m['ttft_long_p90']:.2f}), {m['requests']} requests, {m['failed']} failed, "
                    f"pd {m['router_pd']} ({time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
                runs.append(m)
    med = {
        setup: {
            k: statistics.median(r[k] for r in runs if r["setup"] == setup)
            for k in runs[0]
            if isinstance(runs[0][k], float | int) and k != "rep"
        }
        for setup in ("co-located", "1P1D")
    }
    co, pd = med["co-located"], med["1P1D"]
    return {
        "workload": dataclasses.asdict(w),
        "config": {
            "engine_args": [
                "--num-threads",
                "1",
                "--num-kv-blocks",
                str(args.num_kv_blocks),
                "--max-num-seqs",
                "64",
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
            ],  # fmt: skip
            "pinning": "taskset -c 0 (engine0), -c 1 (engine1); router and client unpinned",
            "pd_threshold": args.threshold,
            "reps": args.reps,
        },
        "runs": runs,
        "median": med,
        "ratios": {
            "itl_p99": co["itl_p99"] / pd["itl_p99"],
            "itl_short_p99": co["itl_short_p99"] / pd["itl_short_p99"],
            "ttft_p90": co["ttft_p90"] / pd["ttft_p90"],
            "ttft_long_p90": co["ttft_long_p90"] / pd["ttft_long_p90"],
            "ttft_short_p90": co["ttft_short_p90"] / pd["ttft_short_p90"],
        },
    }


# ---------------------------------------------------------------------------------------------
# 3. The simulator


def sim_workloads(args) -> list[MixedWorkload]:
    d = args.sim_duration
    return [
        # Long documents (RAG, summarization): prefill dominates.
        MixedWorkload("prefill-heavy", 16, 256, 64, args.sim_long_rate, 6144, 64, d, 0.75),
        # Chat with long answers, a few long prompts among them: decode dominates.
        MixedWorkload("decode-heavy", 96, 512, 256, args.sim_long_rate / 4, 6144, 64, d, 0.75),
    ]


def sim_configs(args) -> list[tuple[int, int]]:
    """(prefill instances, threshold); (0, 0): all co-located."""
    out = [(0, 0)]
    for p in args.sim_splits:
        for t in args.sim_thresholds:
            out.append((p, t))
    return out


def run_sim(
    args, w: MixedWorkload, vocab: Vocab, num_prefill: int, threshold: int, log_root: Path
) -> dict:
    label = (
        "co-located" if not num_prefill else f"{num_prefill}P{args.sim_instances - num_prefill}D"
    )
    log_dir = log_root / f"{w.name}-{label}-{threshold}"
    log_dir.mkdir(parents=True)
    procs = Procs(log_dir)
    scale = args.sim_time_scale
    eps_file = log_dir / "endpoints.yaml"
    argv = [
        PY, "-m", "kvserve.cli", "sim",
        "--num-instances", str(args.sim_instances),
        "--base-port", "0", "--kv-events-base-port", "0", "--no-kv-events-replay",
        "--preset", "h100-llama8b", "--time-scale", str(scale),
        "--max-num-seqs", "128",
        "--max-num-batched-tokens", str(args.sim_max_num_batched_tokens),
        "--num-kv-blocks", str(args.sim_kv_blocks),
        "--model", args.tiny_dir, "--write-endpoints", str(eps_file),
        "--num-prefill-instances", str(num_prefill),
    ]  # fmt: skip
    try:
        p = procs.start("sim", argv)
        deadline = time.monotonic() + 300
        while not eps_file.exists():
            if p.poll() is not None:
                raise RuntimeError(f"kvserve sim exited ({p.returncode}); see {log_dir}")
            if time.monotonic() > deadline:
                raise TimeoutError("kvserve sim did not start")
            time.sleep(0.2)
        sims = yaml.safe_load(eps_file.read_text())
        cfg: dict = {
            "endpoints": sims["endpoints"],
            "tokenizer": args.tiny_dir,
            # 16 servers in one process: patient health checks, scrapes once a second.
            "health": {"timeout_s": 10.0, "unhealthy_after": 5, "metrics_interval_s": 1.0},
            # A prefill leg waits its turn on a busy prefill instance (wall seconds).
            "pd": {"threshold": threshold, "prefill_timeout_s": 120.0 * scale},
        }
        url = start_router(procs, "router", cfg, len(sims["endpoints"]))
        model = sims["endpoints"][0]["model"]
        t0 = time.monotonic()
        records = asyncio.run(drive(url, model, w, vocab, scale=scale, seed=args.seed))
        wall = time.monotonic() - t0
        counts = router_pd_counts(url)
        pace = sim_pace(sims["endpoints"])
    finally:
        procs.stop_all()
    m = measure(records, scale)
    m.pop("endpoints")
    m.update(
        workload=w.name,
        split=label,
        num_prefill=num_prefill,
        threshold=threshold,
        wall_s=round(wall, 1),
        pace=pace,
        router_pd=counts,
    )
    return m


def sim_pace(endpoints: list[dict]) -> float:
    """Busy steps' wall time over their modelled time (1.0: the host kept the pace)."""
    wall = modelled = 0.0
    with httpx.Client(timeout=10, trust_env=False) as c:
        for e in endpoints:
            try:
                s = c.get(e["url"] + "/sim/stats").json()
            except (httpx.HTTPError, ValueError):
                continue
            wall += s["busy_wall_s"]
            modelled += s["busy_modelled_s"]
    return wall / modelled if modelled else float("nan")


def sim_part(args, vocab: Vocab) -> dict:
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-pd-sim-") as tmp:
        for w in sim_workloads(args):
            for num_prefill, threshold in sim_configs(args):
                t0 = time.monotonic()
                m = run_sim(args, w, vocab, num_prefill, threshold, Path(tmp))
                print(
                    f"[sim] {w.name:>13} {m['split']:>10} threshold {threshold:>5}: ITL p99 "
                    f"{m['itl_p99'] * 1e3:.1f} ms, TTFT p90 {m['ttft_p90'] * 1e3:.0f} ms "
                    f"(long {m['ttft_long_p90'] * 1e3:.0f}), out tok/s "
                    f"{m['output_tokens'] / w.duration:.0f}, failed {m['failed']}, pace "
                    f"{m['pace']:.2f}, pd {m['router_pd']} ({time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
                runs.append(m)
    return {
        "workloads": [dataclasses.asdict(w) for w in sim_workloads(args)],
        "config": {
            "instances": args.sim_instances,
            "preset": "h100-llama8b",
            "time_scale": args.sim_time_scale,
            "kv_blocks_per_instance": args.sim_kv_blocks,
            "max_num_batched_tokens": args.sim_max_num_batched_tokens,
            "net_bandwidth_GBps": 50,
            "net_latency_ms": 1,
            "splits": args.sim_splits,
            "thresholds": args.sim_thresholds,
        },
        "runs": runs,
        "best": best_splits(runs),
    }


def frontier(points: list[dict]) -> list[dict]:
    """The runs no other run beats on both ITL p99 and TTFT p90."""
    return [
        p
        for p in points
        if not any(
            q is not p
            and q["itl_p99"] <= p["itl_p99"]
            and q["ttft_p90"] <= p["ttft_p90"]
            and (q["itl_p99"] < p["itl_p99"] or q["ttft_p90"] < p["ttft_p90"])
            for q in points
        )
    ]


def _name(r: dict) -> str:
    return r["split"] + (f" @{r['threshold']}" if r["threshold"] else "")


def best_splits(runs: list[dict]) -> dict:
    """Per workload: the frontier, and the best run that costs no TTFT p90 over co-located."""
    out = {}
    for wname in dict.fromkeys(r["workload"] for r in runs):
        rs = [r for r in runs if r["workload"] == wname and not r["failed"]]
        co = next(r for r in rs if r["split"] == "co-located")
        free = [r for r in rs if r["ttft_p90"] <= co["ttft_p90"] and r is not co]
        best_free = min(free, key=lambda r: r["itl_p99"]) if free else None
        best_itl = min(rs, key=lambda r: r["itl_p99"])
        out[wname] = {
            "co_located": {"itl_p99": co["itl_p99"], "ttft_p90": co["ttft_p90"]},
            "frontier": [(_name(r), r["itl_p99"], r["ttft_p90"]) for r in frontier(rs)],
            "best_itl": (_name(best_itl), best_itl["itl_p99"], best_itl["ttft_p90"]),
            "best_without_ttft_cost": None
            if best_free is None
            else (_name(best_free), best_free["itl_p99"], best_free["ttft_p90"]),
        }
    return out


# ---------------------------------------------------------------------------------------------
# Report


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real, sim = doc.get("real"), doc.get("sim")
    wnames = list(dict.fromkeys(r["workload"] for r in sim["runs"])) if sim else []
    n = (1 if real else 0) + len(wnames)
    fig, axes = plt.subplots(1, max(n, 1), figsize=(5.5 * max(n, 1), 4.6), squeeze=False)
    i = 0
    if real:
        ax = axes[0][i]
        i += 1
        for setup, marker in (("co-located", "o"), ("1P1D", "s")):
            rs = [r for r in real["runs"] if r["setup"] == setup]
            ax.scatter(
                [r["ttft_p90"] for r in rs],
                [r["itl_p99"] * 1e3 for r in rs],
                marker=marker,
                s=60,
                label=setup,
            )
        ax.set_xlabel("TTFT p90 (s)")
        ax.set_ylabel("ITL p99 (ms)")
        ax.set_yscale("log")
        ax.set_title("real engines (small, 1 core each): each run")
        ax.legend()
    for wname in wnames:
        ax = axes[0][i]
        i += 1
        rs = [r for r in sim["runs"] if r["workload"] == wname and not r["failed"]]
        for split in dict.fromkeys(r["split"] for r in rs):
            pts = sorted((r for r in rs if r["split"] == split), key=lambda r: r["threshold"])
            ax.plot(
                [r["ttft_p90"] for r in pts],
                [r["itl_p99"] * 1e3 for r in pts],
                marker="*" if split == "co-located" else "o",
                markersize=12 if split == "co-located" else 6,
                label=split,
            )
            for r in pts:
                if r["threshold"]:
                    ax.annotate(
                        str(r["threshold"]),
                        (r["ttft_p90"], r["itl_p99"] * 1e3),
                        fontsize=7,
                        xytext=(3, 3),
                        textcoords="offset points",
                    )
        front = sorted(frontier(rs), key=lambda r: r["ttft_p90"])
        ax.plot(
            [r["ttft_p90"] for r in front],
            [r["itl_p99"] * 1e3 for r in front],
            "k--",
            linewidth=0.8,
            label="frontier",
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("TTFT p90 (modelled s)")
        ax.set_ylabel("ITL p99 (modelled ms)")
        ax.set_title(f"16 sim H100: {wname} (labels: threshold)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.0f}"


def pd_counts(c: dict) -> str:
    """The router's P/D counters of a run, in words."""
    if not c:
        return ""
    split = sum(v for k, v in c.items() if k.startswith("true:"))
    alone = {k[6:]: v for k, v in c.items() if k.startswith("false:")}
    fb = {k[9:]: v for k, v in c.items() if k.startswith("fallback:")}
    out = f"; router: {split:.0f} split"
    out += "".join(f", {v:.0f} {k}" for k, v in alone.items())
    out += "".join(f", {v:.0f} fallbacks ({k})" for k, v in fb.items())
    if c.get("prefill_legs"):
        out += f", prefill leg mean {c['prefill_leg_seconds_sum'] / c['prefill_legs']:.2f} s"
    return out


def real_markdown(real: dict) -> str:
    w, med, ratio = real["workload"], real["median"], real["ratios"]
    rows = [
        "| setup | ITL p50 ms | ITL p90 ms | ITL p99 ms | ITL p99.9 ms | short reqs' ITL p99 ms |"
        " TTFT p90 s (all) | TTFT p90 short s | TTFT p50 / p90 long s | requests | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for setup in ("co-located", "1P1D"):
        m = med[setup]
        rows.append(
            f"| {setup} | {_ms(m['itl_p50'])} | {_ms(m['itl_p90'])} | {_ms(m['itl_p99'])} | "
            f"{_ms(m['itl_p999'])} | {_ms(m['itl_short_p99'])} | {m['ttft_p90']:.2f} | "
            f"{m['ttft_short_p90']:.2f} | {m['ttft_long_p50']:.2f} / {m['ttft_long_p90']:.2f} | "
            f"{m['requests']:.0f} | {m['failed']:.0f} |"
        )
    per_run = "\n".join(
        f"- {r['setup']} rep {r['rep']}: ITL p99 {_ms(r['itl_p99'])} ms, TTFT p90 "
        f"{r['ttft_p90']:.2f} s (long {r['ttft_long_p90']:.2f} s), load average "
        f"{r['loadavg_1m']:.2f}{pd_counts(r['router_pd'])}"
        for r in real["runs"]
    )
    met = "met" if ratio["itl_p99"] >= 2 else "**not met**"
    cost_all, cost_long, cost_short = (
        1 / ratio[k] for k in ("ttft_p90", "ttft_long_p90", "ttft_short_p90")
    )
    cfg = real["config"]
    return (
        "## 1. Real engines: 1 prefill + 1 decode vs the same two engines co-located\n\n"
        f"Two `kvserve serve` engines (`small` preset, `{' '.join(cfg['engine_args'])}`), "
        f"{cfg['pinning']}; `kvserve route` with `pd.threshold` {cfg['pd_threshold']} tokens "
        "for `1P1D` (`--kv-role producer` / `consumer`); for `co-located` P/D off and both "
        f"engines serving whole requests. Workload: {w['short_concurrency']} users in a closed "
        f"loop of short requests ({w['short_prompt']}-token prompts, {w['short_output']} "
        f"output tokens, streamed), and long-prompt requests ({w['long_prompt']} tokens, "
        f"{w['long_output']} output tokens) arriving at {w['long_rate']:g}/s (Poisson), for "
        f"{w['duration']:g} s; random token ids, nothing shared. Medians of {cfg['reps']} "
        "runs per setup (interleaved); ITL: every gap between streamed tokens of every "
        "request.\n\n"
        + "\n".join(rows)
        + f"\n\n**ITL p99: {ratio['itl_p99']:.1f}x better with disaggregation** (goal >= 2x: "
        f"{met}; the short requests' gaps alone: {ratio['itl_short_p99']:.1f}x). The cost in "
        f"TTFT p90: {cost_all:.2f}x of co-located over all requests; long prompts "
        f"{cost_long:.2f}x (one prefill engine does every long prefill that two engines "
        f"shared, and the KV is pulled before the first token); short prompts {cost_short:.2f}x "
        "(their prefills no longer wait behind chunks of long ones). Per run:\n\n" + per_run + "\n"
    )


def sim_markdown(sim: dict) -> str:
    cfg = sim["config"]
    out = [
        f"""## 3. Cluster scale in the simulator: xPyD splits vs all co-located

{cfg["instances"]} `kvserve sim` instances (`{cfg["preset"]}`: Llama-3.1-8B on H100,
{cfg["kv_blocks_per_instance"]} KV blocks each; `max_num_batched_tokens`
{cfg["max_num_batched_tokens"]}: chunked prefill, each chunk a step the batch's decodes wait
for; KV pulls between instances take 1 ms + bytes / 50 GB/s per link, one
link each way per instance) behind `kvserve route`, time scale {cfg["time_scale"]:g} (the
`pace` column: busy steps' wall time over modelled time, 1.0 = kept up). Every latency is in
modelled seconds. Splits: xPyD = x prefill instances (`--kv-role producer`), y decode
instances; threshold = the router's `pd.threshold` (uncached prompt tokens on the chosen
decode instance from which a request is split).
"""
    ]
    for wd in sim["workloads"]:
        rs = [r for r in sim["runs"] if r["workload"] == wd["name"]]
        out.append(
            f"### {wd['name']}\n\n{wd['short_concurrency']} users in a closed loop of "
            f"{wd['short_prompt']}-token prompts / {wd['short_output']} output tokens, and "
            f"{wd['long_prompt']}-token prompts / {wd['long_output']} output tokens arriving at "
            f"{wd['long_rate']:g}/s, for {wd['duration']:g} s; prompt lengths uniform within "
            f"+-{wd['spread']:.0%} of those.\n"
        )
        out.append(
            "| split | threshold | ITL p50 ms | ITL p99 ms | TTFT p90 ms | TTFT p90 long ms | "
            "TTFT p90 short ms | output tok/s | split / not split | fallbacks | failed | pace |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rs:
            pd = r["router_pd"]
            split = sum(v for k, v in pd.items() if k.startswith("true:"))
            alone = sum(v for k, v in pd.items() if k.startswith("false:"))
            fb = sum(v for k, v in pd.items() if k.startswith("fallback:"))
            out.append(
                f"| {r['split']} | {r['threshold'] or '-'} | {r['itl_p50'] * 1e3:.1f} | "
                f"{r['itl_p99'] * 1e3:.1f} | {_ms(r['ttft_p90'])} | {_ms(r['ttft_long_p90'])} | "
                f"{_ms(r['ttft_short_p90'])} | {r['output_tokens'] / wd['duration']:.0f} | "
                f"{split:.0f} / {alone:.0f} | {fb:.0f} | {r['failed']} | {r['pace']:.2f} |"
            )
        best = best_splits(sim["runs"]).get(wd["name"])
        if best:
            co = best["co_located"]
            front = ", ".join(
                f"{n} ({i * 1e3:.1f} ms, {f * 1e3:.0f} ms)" for n, i, f in best["frontier"]
            )
            n, i, f = best["best_itl"]
            text = (
                f"\nFrontier (ITL p99, TTFT p90): {front}. Lowest ITL p99: {n}, "
                f"{co['itl_p99'] / i:.1f}x better than co-located at {f / co['ttft_p90']:.2f}x "
                "its TTFT p90"
            )
            if best["best_without_ttft_cost"]:
                n, i, f = best["best_without_ttft_cost"]
                text += (
                    f"; the best without a TTFT cost: {n}, ITL p99 {co['itl_p99'] / i:.1f}x "
                    f"better at {f / co['ttft_p90']:.2f}x the TTFT p90"
                )
            out.append(text + ".\n")
    return "\n".join(out)


def write_report(doc: dict, out: Path) -> None:
    if doc.get("sim"):
        doc["sim"]["best"] = best_splits(doc["sim"]["runs"])
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    plot(doc, out.with_suffix(".png"))
    parts = []
    if doc.get("real"):
        parts.append(real_markdown(doc["real"]))
    if doc.get("sim"):
        parts.append(sim_markdown(doc["sim"]))
    machine = doc["machine"]
    md = f"""# Prefill/decode disaggregation

`.venv/bin/python benchmarks/bench_pd.py` ({doc["date"]}). Benchmark 2 of issue 12 (KV transfer
bandwidth) is recorded separately by the engine side.

## Machine
{machine_markdown(machine)}
{chr(10).join(parts)}
![P/D](pd.png)
"""
    out.with_suffix(".md").write_text(md)


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt  # unwinds through every `finally`: child processes are stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="real,sim", help="real, sim or both (comma-separated)")
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "pd"))
    ap.add_argument(
        "--report-only", action="store_true", help="rewrite the .md and .png from the .json"
    )
    g = ap.add_argument_group("1. real engines")
    g.add_argument("--model-dir", help="small preset directory (default: created in the cache)")
    g.add_argument("--reps", type=int, default=2)
    g.add_argument("--duration", type=float, default=90.0)
    g.add_argument("--short-concurrency", type=int, default=8)
    g.add_argument("--short-prompt", type=int, default=64)
    g.add_argument("--short-output", type=int, default=96)
    g.add_argument("--long-rate", type=float, default=0.2, help="long prompts per second")
    g.add_argument("--long-prompt", type=int, default=1536)
    g.add_argument("--long-output", type=int, default=32)
    g.add_argument("--threshold", type=int, default=512, help="pd.threshold of 1P1D")
    g.add_argument("--num-kv-blocks", type=int, default=1024)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g = ap.add_argument_group("3. simulator")
    g.add_argument("--sim-instances", type=int, default=16)
    g.add_argument("--sim-splits", type=int, nargs="+", default=[2, 4, 8])
    g.add_argument("--sim-thresholds", type=int, nargs="+", default=[512, 2048, 8192])
    g.add_argument("--sim-duration", type=float, default=12.0, help="modelled seconds")
    g.add_argument("--sim-long-rate", type=float, default=16.0, help="long prompts per second")
    g.add_argument("--sim-time-scale", type=float, default=16.0)
    g.add_argument("--sim-kv-blocks", type=int, default=8192)
    g.add_argument(
        "--sim-max-num-batched-tokens",
        type=int,
        default=2048,
        help="chunked prefill: a 6k prompt takes 3 steps, each stalling the batch's decodes",
    )
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if parts - {"real", "sim"}:
        ap.error("--parts takes real and/or sim")
    if args.quick:
        args.reps, args.duration = 1, 20.0
        args.sim_instances, args.sim_splits, args.sim_thresholds = 4, [1], [512]
        args.sim_duration, args.sim_long_rate = 3.0, 4.0
    from kvserve.bench.cli import default_model_dir
    from kvserve.sim.instance import default_model_dir as tiny_dir

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict = {}
    if out.with_suffix(".json").exists() and not args.quick:
        doc = json.loads(out.with_suffix(".json").read_text())
    if args.report_only:
        write_report(doc, out)
        return 0
    doc.update(date=time.strftime("%Y-%m-%d"), machine=describe_machine())
    if "real" in parts:
        args.model_dir = str(args.model_dir or default_model_dir("small"))
        doc["real"] = real_part(args, Vocab.from_model_dir(args.model_dir))
        doc["machine"] = describe_machine()
    if "sim" in parts:
        args.tiny_dir = str(tiny_dir())
        doc["sim"] = sim_part(args, Vocab.from_model_dir(args.tiny_dir))
        doc["machine"] = describe_machine()
    write_report(doc, out)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
