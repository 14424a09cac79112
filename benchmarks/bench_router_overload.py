"""Router overload: bursts of concurrent clients against `kvserve route` with its default limits.

Issue 17 item 7: above ~7,500 concurrent requests the router used to count connect timeouts
in an engine's accept backlog as "endpoint down", eject every engine within a millisecond
and answer 502. Now connections per endpoint are capped (256) with a FIFO queue behind them
(1,024 per endpoint, 60 s at most), beyond which the router answers 503 with Retry-After,
and an endpoint is ejected only on evidence (refused connections, failed health checks).

Setup: two fake engines (aiohttp, one process) that each run at most ``--engine-slots``
requests at once for ``--service-s`` seconds (the rest wait in the engine, as in an engine's
scheduler queue) and listen with uvicorn's accept backlog (2,048); the real router (its own
process, default configuration); this process opens C connections at once, one request each
(``--concurrency``), waits for every answer, and records statuses, Retry-After, latency and
the router's endpoint ejections. Between bursts the router drains.

Measured: the smallest burst at which the router answers 503 instead of queueing (the
queueing capacity is 2 x (256 + 1,024) = 2,560 requests in the router, plus what finishes
while the burst arrives), that nothing is ejected below or above it, never a 502, and the
latency p50 / p99 of served requests vs concurrency.

    .venv/bin/python benchmarks/bench_router_overload.py    # ~2-3 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from kvserve.bench.machine import describe_machine, machine_markdown
from kvserve.cluster.config import RouterConfig

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "bench-model"


# --------------------------------------------------------------------------- fake engines


async def serve_engines(n: int, slots: int, service_s: float) -> None:
    from aiohttp import web

    body = json.dumps(
        {
            "id": "cmpl-x",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "text": " hello", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
        }
    ).encode()
    ports = []
    for _ in range(n):
        running = asyncio.Semaphore(slots)  # the engine's batch; the rest wait in its queue

        async def complete(request: web.Request, running=running) -> web.Response:
            await request.read()
            async with running:
                await asyncio.sleep(service_s)
            return web.Response(body=body, content_type="application/json")

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL}]})

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text="vllm:num_requests_running 0\n")

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=2048)
        await site.start()
        ports.append(site._server.sockets[0].getsockname()[1])
    print(json.dumps({"ports": ports}), flush=True)
    await asyncio.Event().wait()


# --------------------------------------------------------------------------- load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(port: int, payload: bytes) -> tuple[int | str, bool, float]:
    """(status or error name, whether Retry-After came, seconds)."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(payload)
            data = await asyncio.wait_for(reader.read(), 300)
        finally:
            writer.close()
    except (OSError, TimeoutError) as e:
        return type(e).__name__, False, time.perf_counter() - t0
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    try:
        status: int | str = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        status = "bad_response"
    return status, b"\r\nretry-after:" in head, time.perf_counter() - t0


async def get_json(port: int, path: str) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def burst(port: int, concurrency: int) -> dict:
    body = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 1}).encode()
    payload = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
    )
    out_seen: list[str] = []
    watch = asyncio.create_task(_watch_health(port, out_seen))
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_request(port, payload) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    watch.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watch
    statuses = Counter(str(s) for s, _, _ in results)
    ok = [t for s, _, t in results if s == 200]
    shed = [(s, ra, t) for s, ra, t in results if s in (429, 503)]
    state = await get_json(port, "/router/state")
    return {
        "concurrency": concurrency,
        "statuses": dict(statuses),
        "served": len(ok),
        "shed": len(shed),
        "shed_with_retry_after": sum(ra for _, ra, _ in shed),
        "served_p50_s": pct(ok, 0.5),
        "served_p99_s": pct(ok, 0.99),
        "shed_p50_s": pct([t for _, _, t in shed], 0.5),
        "wall_s": wall,
        "ejections_total": sum(e["ejections"] for e in state["endpoints"]),
        "unhealthy_seen_during_burst": sorted(set(out_seen)),
        "loadavg_1m": os.getloadavg()[0],
    }


async def _watch_health(port: int, out_seen: list[str]) -> None:
    """Samples /router/state during a burst: the endpoints seen out of rotation."""
    while True:
        with contextlib.suppress(OSError, ValueError, IndexError):
            state = await get_json(port, "/router/state")
            out_seen += [e["name"] for e in state["endpoints"] if not e["healthy"]]
        await asyncio.sleep(0.25)


async def drain(port: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        state = await get_json(port, "/router/state")
        if all(e["in_flight"] == 0 and e["queued"] == 0 for e in state["endpoints"]):
            return
        await asyncio.sleep(0.2)
    raise SystemExit("router did not drain")


async def measure(port: int, levels: list[int]) -> list[dict]:
    rows = []
    await burst(port, 50)  # warm up connections
    await drain(port)
    for c in levels:
        row = await burst(port, c)
        print(json.dumps(row), flush=True)
        rows.append(row)
        await drain(port)
        await asyncio.sleep(1.0)  # kept-alive connections idle; the machine settles
    return rows


def wait_healthy(url: str, proc: subprocess.Popen) -> None:
    import urllib.error
    import urllib.request

    deadline = time.time() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise SystemExit("router did not come up")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[250, 500, 1000, 2000, 2500, 2600, 2800, 3000, 4000, 6000, 8000],
    )
    ap.add_argument("--engine-slots", type=int, default=64, help="requests an engine runs at once")
    ap.add_argument("--service-s", type=float, default=0.1, help="seconds per request")
    ap.add_argument("--serve-engines", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / "router_overload"))
    args = ap.parse_args()
    if args.serve_engines:
        import uvloop

        uvloop.run(serve_engines(2, args.engine_slots, args.service_s))
        return

    engines = subprocess.Popen(
        [sys.executable, __file__, "--serve-engines"]
        + ["--engine-slots", str(args.engine_slots), "--service-s", str(args.service_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    router = None
    try:
        ports = json.loads(engines.stdout.readline())["ports"]
        rport = free_port()
        cmd = [sys.executable, "-m", "kvserve.cli", "route", "--port", str(rport)]
        for p in ports:
            cmd += ["--endpoint", f"http://127.0.0.1:{p},model={MODEL}"]
        router = subprocess.Popen(cmd)
        wait_healthy(f"http://127.0.0.1:{rport}/health", router)
        import uvloop

        t0 = time.time()
        rows = uvloop.run(measure(rport, args.concurrency))
        took = time.time() - t0
    finally:
        for p in (router, engines):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()

    defaults = RouterConfig()
    capacity = 2 * (defaults.max_connections_per_endpoint + defaults.max_queue_per_endpoint)
    first_shed = next((r["concurrency"] for r in rows if r["shed"] > 0), None)
    last_queued = max((r["concurrency"] for r in rows if r["shed"] == 0), default=None)
    machine = describe_machine()
    record = {
        "benchmark": "router_overload",
        "machine": machine,
        "config": {
            "engines": 2,
            "engine_slots": args.engine_slots,
            "service_s": args.service_s,
            "max_connections_per_endpoint": defaults.max_connections_per_endpoint,
            "max_queue_per_endpoint": defaults.max_queue_per_endpoint,
            "queue_timeout_s": defaults.queue_timeout_s,
            "router_queueing_capacity": capacity,
        },
        "largest_burst_all_queued": last_queued,
        "smallest_burst_with_503": first_shed,
        "ejections": sum(r["ejections_total"] for r in rows),
        "any_502": any("502" in r["statuses"] for r in rows),
        "took_s": took,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "| concurrent clients | served (200) | 503 (with Retry-After) | other | served p50 / p99 s "
        "| 503 p50 s | burst wall s | endpoint ejections | load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        other = sum(v for k, v in r["statuses"].items() if k not in ("200", "503", "429"))
        lines.append(
            f"| {r['concurrency']:,} | {r['served']:,} | {r['shed']:,} "
            f"({r['shed_with_retry_after']:,}) | {other} | "
            f"{r['served_p50_s']:.2f} / {r['served_p99_s']:.2f} | "
            f"{r['shed_p50_s']:.2f} | {r['wall_s']:.1f} | "
            f"{r['ejections_total']}{' (seen out)' if r['unhealthy_seen_during_burst'] else ''} "
            f"| {r['loadavg_1m']:.1f} |".replace("| nan |", "| - |")
        )
    summary = [
        f"- The router queues every request of a burst up to {last_queued:,} concurrent clients "
        f"and first answers 503 (with Retry-After) at {first_shed:,} in this sweep; its "
        f"queueing capacity is 2 x ({defaults.max_connections_per_endpoint} connections + "
        f"{defaults.max_queue_per_endpoint} queued) = {capacity:,} requests, plus what the "
        "engines finish while the burst arrives."
        if first_shed and last_queued
        else "- No burst of this sweep crossed the queueing capacity.",
        f"- Endpoint ejections over the whole run: {record['ejections']}; 502 answers: "
        f"{'some' if record['any_502'] else 'none'}.",
    ]
    md = f"""# Router overload (`kvserve route`, default limits)

`.venv/bin/python benchmarks/bench_router_overload.py` ({time.strftime("%Y-%m-%d")}, {took:.0f} s).
Load generator, router and fake engines share the machine's cores.

## Machine
{machine_markdown(machine)}
## Setup
Two fake engines (one aiohttp process), each running at most {args.engine_slots} requests at
once for {args.service_s} s (the rest wait inside the engine), accept backlog 2,048. The router
with its defaults: {defaults.max_connections_per_endpoint} connections per endpoint, a FIFO
queue of {defaults.max_queue_per_endpoint} requests per endpoint (at most
{defaults.queue_timeout_s:.0f} s), then 503 + Retry-After. Each burst: C clients connect at
once, one request each; the router drains between bursts. "served p50 / p99": latency of the
200 answers (queueing included); "503 p50": how fast the shed ones were told.

## Results
{chr(10).join(lines)}

{chr(10).join(summary)}
"""
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
