"""Router overhead: latency `kvserve route` adds per request, at 50, 200 and 500 req/s.

Goals (issue 4): added p50 <= 1 ms and p99 <= 5 ms at 200 req/s.

Four fast fake OpenAI backends (aiohttp, one process) answer a completion at once. The real
router (`kvserve route`, its own process, default scheduler: prefix scorers, load, queue,
KV utilization) sits in front of them. This process sends open-loop Poisson traffic of
`/v1/completions` requests (1,024-token prompts given as token ids: one of 8 shared 768-token
system prompts + a 256-token tail unique to the request, so the router hashes 63 blocks,
its routing history has hits and its prompt-chunk memo hits the system prompt only) and, in the
same run, the same traffic straight to the backends and through a bare proxy: the router's own
HTTP layer (kvserve.cluster.http_server + upstream) forwarding round robin without parsing or
routing, i.e. the cost of the extra hop alone. Phases rotate direct / bare / routed
(``--blocks`` blocks of ``--block-s`` seconds each per rate) so all see the same machine;
the overhead is routed minus direct, percentile by percentile (bare minus direct: the hop;
routed minus bare: routing). The router's CPU time per request (from /proc) is reported too:
unlike latency it does not depend on what else runs.

    .venv/bin/python benchmarks/bench_router_overhead.py [--pin]   # ~3 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from kvserve.bench.machine import describe_machine, machine_markdown
from kvserve.cluster.config import default_scorers

RESULTS = Path(__file__).resolve().parent / "results"
PIN_NOTE = (
    "CPU pinning: load generator and fake backends on CPU 0, the router (and the bare proxy) "
    "on CPU 1, i.e. the router on a core of its own, as a deployment would give it."
)
SHARED_NOTE = (
    "No CPU pinning: load generator, fake backends and router share both cores; each "
    "process's wake-ups wait for the others."
)
MODEL = "bench-model"


# --------------------------------------------------------------------------- fake backends


async def serve_backends(n: int) -> None:
    from aiohttp import web

    body = json.dumps(
        {
            "id": "cmpl-x",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "text": " hello", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1024, "completion_tokens": 1, "total_tokens": 1025},
        }
    ).encode()

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            "vllm:kv_cache_usage_perc 0.1\n"
        )

    ports = []
    for _ in range(n):
        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.append(site._server.sockets[0].getsockname()[1])
    print(json.dumps({"ports": ports}), flush=True)
    await asyncio.Event().wait()


async def serve_bare_proxy(port: int, backends: list[str]) -> None:
    """The hop alone: the router's HTTP layer forwarding round robin, nothing parsed."""
    from kvserve.cluster.gateway import error_reply
    from kvserve.cluster.http_server import HttpRequest, HttpResponse, HttpServer
    from kvserve.cluster.upstream import Origin, UpstreamPool

    pool = UpstreamPool()
    origins = [Origin.from_url(b) for b in backends]
    counter = 0

    async def forward(req: HttpRequest, resp: HttpResponse) -> None:
        nonlocal counter
        counter += 1
        up = await pool.request(
            origins[counter % len(origins)],
            req.method,
            req.path,
            [(k, v) for k, v in req.headers if k.lower() not in (b"host", b"content-length")],
            req.body,
            first_byte_timeout_s=60,
        )
        data = up.take_buffered() if up.complete else await up.read(60)
        resp.send(up.status, [(b"content-type", b"application/json")], data)
        up.release()

    await HttpServer(forward, error_reply).start("127.0.0.1", port)
    await asyncio.Event().wait()


# --------------------------------------------------------------------------- load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, as getrusage would give them."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tck, int(fields[12]) / tck


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    srng = random.Random(0)  # the same 8 system prompts in every phase
    systems = [[srng.randrange(32000) for _ in range(768)] for _ in range(8)]
    rng = random.Random(seed)
    return [rng.choice(systems) + [rng.randrange(32000) for _ in range(256)] for _ in range(n)]


async def run_phase(
    session: aiohttp.ClientSession, urls: list[str], rate: float, seconds: float, seed: int
) -> tuple[list[float], int]:
    """Open-loop Poisson arrivals for ``seconds``; returns latencies (ms) and errors."""
    rng = random.Random(seed)
    # Every request its own prompt (a shared system prompt + a unique tail), built up front.
    prompts = make_prompts(int(rate * seconds * 1.3) + 64, seed)
    bodies = [json.dumps({"model": MODEL, "prompt": p, "max_tokens": 1}) for p in prompts]
    lat: list[float] = []
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        url = urls[i % len(urls)]
        t0 = time.perf_counter()
        try:
            async with session.post(
                url, data=bodies[i % len(bodies)], headers={"Content-Type": "application/json"}
            ) as r:
                await r.read()
                ok = r.status == 200
        except aiohttp.ClientError:
            ok = False
        if ok:
            lat.append((time.perf_counter() - t0) * 1e3)
        else:
            errors += 1

    tasks = []
    start = time.perf_counter()
    t, i = 0.0, 0
    while t < seconds:
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        t += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return lat, errors


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def routing_seconds(session: aiohttp.ClientSession, router: str) -> tuple[float, float]:
    async with session.get(router + "/metrics") as r:
        text = await r.text()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("kvserve_router_routing_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("kvserve_router_routing_seconds_count"):
            count = float(line.split()[-1])
    return total, count


async def measure(
    args: argparse.Namespace,
    backends: list[str],
    router: str,
    bare: str,
    pid: int,
    bare_pid: int,
) -> list:
    rows = []
    conn = aiohttp.TCPConnector(limit=0)
    urls_of = {
        "direct": [b + "/v1/completions" for b in backends],
        "bare": [bare + "/v1/completions"],
        "routed": [router + "/v1/completions"],
    }
    async with aiohttp.ClientSession(connector=conn) as s:
        for kind, urls in urls_of.items():  # warm up connections, caches
            await run_phase(s, urls, 100, 2.0 if kind == "routed" else 1.0, seed=99)
        for rate in args.rates:
            lat: dict[str, list[float]] = {k: [] for k in urls_of}
            errors = dict.fromkeys(urls_of, 0)
            cpu_user = cpu_sys = bare_cpu = 0.0
            n_routed = n_bare = 0
            rs0 = await routing_seconds(s, router)
            for k in range(args.blocks):
                for kind, urls in urls_of.items():
                    c0, b0 = proc_cpu_s(pid), proc_cpu_s(bare_pid)
                    got, err = await run_phase(s, urls, rate, args.block_s, seed=1000 * k)
                    if kind == "routed":
                        c1 = proc_cpu_s(pid)
                        cpu_user += c1[0] - c0[0]
                        cpu_sys += c1[1] - c0[1]
                        n_routed += len(got) + err
                    elif kind == "bare":
                        bare_cpu += sum(proc_cpu_s(bare_pid)) - sum(b0)
                        n_bare += len(got) + err
                    lat[kind].extend(got)
                    errors[kind] += err
            rs1 = await routing_seconds(s, router)
            row: dict = {"rate": rate, "errors": errors}
            for kind, xs in lat.items():
                row[f"requests_{kind}"] = len(xs)
                row[f"{kind}_p50_ms"] = pct(xs, 0.5)
                row[f"{kind}_p99_ms"] = pct(xs, 0.99)
            for q in ("p50", "p99"):
                row[f"overhead_{q}_ms"] = row[f"routed_{q}_ms"] - row[f"direct_{q}_ms"]
                row[f"hop_{q}_ms"] = row[f"bare_{q}_ms"] - row[f"direct_{q}_ms"]
            row.update(
                {
                    "router_cpu_ms_per_request": 1e3 * (cpu_user + cpu_sys) / max(n_routed, 1),
                    "router_user_cpu_ms_per_request": 1e3 * cpu_user / max(n_routed, 1),
                    "router_sys_cpu_ms_per_request": 1e3 * cpu_sys / max(n_routed, 1),
                    "bare_proxy_cpu_ms_per_request": 1e3 * bare_cpu / max(n_bare, 1),
                    "router_routing_ms_mean": 1e3 * (rs1[0] - rs0[0]) / max(rs1[1] - rs0[1], 1),
                    "loadavg_1m": os.getloadavg()[0],
                }
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def wait_healthy(url: str, proc: subprocess.Popen, what: str) -> None:
    import urllib.error
    import urllib.request

    deadline = time.time() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answers HTTP
        except OSError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise SystemExit(f"{what} did not come up")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[50, 200, 500])
    ap.add_argument("--blocks", type=int, default=3, help="direct/bare/routed rounds per rate")
    ap.add_argument("--block-s", type=float, default=4.0)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--serve-backends", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-bare-proxy", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pin the load generator and backends to CPU 0 and the proxies to CPU 1 "
        "(a router deployed on a core of its own)",
    )
    ap.add_argument("--out", default=str(RESULTS / "router_overhead"))
    args = ap.parse_args()
    if args.serve_backends:
        asyncio.run(serve_backends(args.serve_backends))
        return
    if args.serve_bare_proxy:
        import uvloop

        port, *backends = args.serve_bare_proxy
        uvloop.run(serve_bare_proxy(int(port), backends))
        return

    backend_proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-backends", str(args.backends)],
        stdout=subprocess.PIPE,
        text=True,
    )
    router_proc = bare_proc = None
    try:
        ports = json.loads(backend_proc.stdout.readline())["ports"]
        backends = [f"http://127.0.0.1:{p}" for p in ports]
        rport, bport = free_port(), free_port()
        cmd = [sys.executable, "-m", "kvserve.cli", "route", "--port", str(rport)]
        for b in backends:
            cmd += ["--endpoint", f"{b},model={MODEL}"]
        router_proc = subprocess.Popen(cmd)
        bare_proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-bare-proxy", str(bport), *backends]
        )
        router = f"http://127.0.0.1:{rport}"
        bare = f"http://127.0.0.1:{bport}"
        wait_healthy(router + "/health", router_proc, "router")
        wait_healthy(bare + "/health", bare_proc, "bare proxy")
        if args.pin:
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                raise SystemExit("--pin needs 2 CPUs")
            for p in (0, backend_proc.pid):
                os.sched_setaffinity(p, {cpus[0]})
            for p in (router_proc.pid, bare_proc.pid):
                for tid in os.listdir(f"/proc/{p}/task"):  # every thread of the proxy
                    os.sched_setaffinity(int(tid), {cpus[1]})
        all_cpus = os.sched_getaffinity(0)
        try:
            rows = asyncio.run(
                measure(args, backends, router, bare, router_proc.pid, bare_proc.pid)
            )
        finally:
            os.sched_setaffinity(0, all_cpus)  # the machine report counts every core
    finally:
        for p in (router_proc, bare_proc, backend_proc):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()

    machine = describe_machine()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:10]
    record = {
        "benchmark": "router_overhead",
        "machine": machine,
        "lscpu": lscpu,
        "nproc": os.cpu_count(),
        "config": {
            "backends": args.backends,
            "blocks": args.blocks,
            "block_s": args.block_s,
            "prompt_tokens": 1024,
            "pinned": args.pin,
            "scheduler": "default ("
            + ", ".join(f"{x.name} {x.weight:g}" for x in default_scorers())
            + ")",
        },
        "rows": rows,
        "goals": {"rate": 200, "overhead_p50_ms": 1.0, "overhead_p99_ms": 5.0},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "| req/s | n per arm | direct p50 / p99 ms | bare proxy p50 / p99 ms | "
        "routed p50 / p99 ms | hop (bare - direct) p50 / p99 ms | "
        "**overhead (routed - direct) p50 / p99 ms** | CPU ms/req bare / router | "
        "routing ms (mean) | errors | load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']:.0f} | {r['requests_routed']} | "
            f"{r['direct_p50_ms']:.2f} / {r['direct_p99_ms']:.2f} | "
            f"{r['bare_p50_ms']:.2f} / {r['bare_p99_ms']:.2f} | "
            f"{r['routed_p50_ms']:.2f} / {r['routed_p99_ms']:.2f} | "
            f"{r['hop_p50_ms']:.2f} / {r['hop_p99_ms']:.2f} | "
            f"**{r['overhead_p50_ms']:.2f} / {r['overhead_p99_ms']:.2f}** | "
            f"{r['bare_proxy_cpu_ms_per_request']:.2f} / {r['router_cpu_ms_per_request']:.2f} | "
            f"{r['router_routing_ms_mean']:.3f} | "
            f"{sum(r['errors'].values())} | {r['loadavg_1m']:.1f} |"
        )
    lscpu_text = "\n".join(lscpu)
    verdict = []
    for r in rows:
        if r["rate"] == 200:
            met = r["overhead_p50_ms"] <= 1.0 and r["overhead_p99_ms"] <= 5.0
            verdict.append(
                f"- At 200 req/s: overhead p50 {r['overhead_p50_ms']:.2f} ms, p99 "
                f"{r['overhead_p99_ms']:.2f} ms: goal {'met' if met else 'NOT met'} on this run."
            )
    cpu = [r["router_cpu_ms_per_request"] for r in rows]
    if cpu:
        c = statistics.median(cpu)
        verdict.append(
            f"- The router spent {c:.2f} ms of CPU per request (median over rates), i.e. one "
            f"free core serves about {1000 / c:.0f} req/s; when the machine cannot give it "
            "that much CPU, requests queue and the added latency is queueing, not routing."
        )
    md = f"""# Router overhead (`kvserve route` vs direct)

`.venv/bin/python benchmarks/bench_router_overhead.py{" --pin" if args.pin else ""}` \
({time.strftime("%Y-%m-%d")}). Goal: added latency p50 <= 1 ms and p99 <= 5 ms at 200 req/s.
{PIN_NOTE if args.pin else SHARED_NOTE}

## Machine
{machine_markdown(machine)}
```
{lscpu_text}
nproc: {os.cpu_count()}
```

## Results
{args.backends} fake backends, 1,024-token token-id prompts, open-loop Poisson arrivals,
{args.blocks} rounds of {args.block_s:.0f} s direct, {args.block_s:.0f} s through a bare proxy
and {args.block_s:.0f} s routed per rate, interleaved. Overhead = routed - direct at the same
percentile; "hop" = bare proxy - direct: what one more loopback HTTP hop costs with the router's
HTTP layer and no routing. "load" is the machine's 1-minute load average (2 cores).

{chr(10).join(lines)}

{chr(10).join(verdict)}
"""
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
