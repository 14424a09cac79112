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

First, on the same router (fresh; it tokenizes with the tiny preset's tokenizer, as one doing
precise prefix scoring does), the maximal request (issue 17 item 1): the largest body it
accepts by default (``max_body_bytes``: exactly that many bytes read, one byte more 413);
/health latency p50 / p99 idle and while bodies of exactly that size (one completions
prompt, then one chat message, of text sparse in tokens so that the most text is tokenized
before the router's token cap) are read, decoded, tokenized and forwarded, probed every
20 ms; another client's small completion meanwhile; the router's RSS after a warm-up, at its
peak and after each maximal request.

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
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import msgspec

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
    chat_body = json.dumps(
        {
            "id": "chatcmpl-x",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " hello"},
                    "finish_reason": "length",
                }
            ],
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
            answer = chat_body if request.path.endswith("/chat/completions") else body
            return web.Response(body=answer, content_type="application/json")

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL}]})

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text="vllm:num_requests_running 0\n")

        app = web.Application(client_max_size=256 << 20)  # the router's limit decides
        app.router.add_post("/v1/completions", complete)
        app.router.add_post("/v1/chat/completions", complete)
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


# --------------------------------------------------------------------------- maximal request

# ~11.6 characters per token with the tiny vocabulary (prose has ~4): the router tokenizes
# the most text before it reaches its token cap.
SPARSE = " mathematician grandmother wavelengths experiments clockmaker carefully Wednesday"


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def http_request(path: str, body: bytes | None = None, length: int | None = None) -> bytes:
    """One request's bytes (``connection: close``); ``length``: the Content-Length to declare
    (the body's by default)."""
    if body is None and length is None:
        return f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode()
    body = body or b""
    n = len(body) if length is None else length
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
        f"content-type: application/json\r\ncontent-length: {n}\r\n\r\n"
    ).encode() + body


def exchange(port: int, payload: bytes, timeout: float = 300.0) -> tuple[int | str, float]:
    """Send ``payload`` on a new connection and read the answer to EOF (blocking: the socket
    calls release the GIL). (status or error name, seconds)."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(payload)
            data = bytearray()
            while chunk := sock.recv(1 << 16):
                data += chunk
    except OSError as e:
        return type(e).__name__, time.perf_counter() - t0
    try:
        status: int | str = int(bytes(data[:16]).split(b" ", 2)[1])
    except (IndexError, ValueError):
        status = "bad_response"
    return status, time.perf_counter() - t0


def sparse_text(chars: int) -> str:
    return (SPARSE * (chars // len(SPARSE) + 1))[:chars]


def maximal_body(kind: str, size: int) -> bytes:
    """A body of exactly ``size`` bytes: one completions prompt, or one chat message."""
    if kind == "chat":
        head = b'{"model": "%b", "max_tokens": 1, "messages": [{"role": "user", "content": "'
        tail = b'"}]}'
    else:
        head, tail = b'{"model": "%b", "max_tokens": 1, "prompt": "', b'"}'
    head %= MODEL.encode()
    return head + sparse_text(size - len(head) - len(tail)).encode() + tail


def probe(port: int, pid: int, busy: threading.Thread | float) -> tuple[list, list, int]:
    """While ``busy`` runs (or for that many seconds): /health every 20 ms, and from another
    thread small completions, 0.05 s apart; their latencies and the router's peak RSS."""
    health = http_request("/health")
    small = http_request(
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "Hi there", "max_tokens": 2}).encode(),
    )
    end = time.monotonic() + busy if isinstance(busy, float) else float("inf")

    def running() -> bool:
        return time.monotonic() < end and (isinstance(busy, float) or busy.is_alive())

    other_s: list[float] = []

    def other_client() -> None:
        while running():
            status, took = exchange(port, small, 30)
            assert status == 200, status
            other_s.append(took)
            time.sleep(0.05)

    other = threading.Thread(target=other_client)
    other.start()
    health_s: list[float] = []
    peak = 0
    while running():
        status, took = exchange(port, health, 30)
        assert status == 200, status
        health_s.append(took)
        peak = max(peak, rss(pid))
        time.sleep(0.02)
    other.join()
    return health_s, other_s, peak


def measure_maximal(port: int, pid: int, limit: int, repeats: int, tokenizer: str) -> dict:
    # Warm-up: the tokenizer loaded, a long prompt tokenized on a worker thread, the chat
    # template rendered.
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL, "prompt": sparse_text(300_000), "max_tokens": 1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ):
        status, _ = exchange(port, http_request(path, json.dumps(body).encode()))
        assert status == 200, (path, status)
    time.sleep(1.0)
    idle_health, idle_other, _ = probe(port, pid, 5.0)
    before = rss(pid)
    over, _ = exchange(port, http_request("/v1/completions", length=limit + 1))
    runs = []
    for kind in ("completions", "chat"):
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        payload = http_request(path, maximal_body(kind, limit))
        for _ in range(repeats):
            result: dict = {}

            def send(payload: bytes = payload, result: dict = result) -> None:
                result["status"], result["s"] = exchange(port, payload)

            sender = threading.Thread(target=send)
            sender.start()
            health_s, other_s, peak = probe(port, pid, sender)
            sender.join()
            time.sleep(1.0)  # settled
            runs.append(
                {
                    "kind": kind,
                    "status": result["status"],
                    "seconds": result["s"],
                    "health_s": health_s,
                    "other_s": other_s,
                    "rss_peak": peak,
                    "rss_after": rss(pid),
                }
            )
            print(json.dumps({k: v for k, v in runs[-1].items() if not k.endswith("_s")}))
        del payload
    after = rss(pid)
    # The work the router's event loop does for a whole body at once, timed here alone (same
    # libraries): joining the chunks it was read in, and decoding the JSON.
    body = maximal_body("completions", limit)
    pieces = [body[i : i + (256 << 10)] for i in range(0, len(body), 256 << 10)]
    t = time.perf_counter()
    joined = b"".join(pieces)
    join_s = time.perf_counter() - t
    del pieces, body
    t = time.perf_counter()
    decoded = msgspec.json.decode(joined)
    decode_s = time.perf_counter() - t
    del joined
    # What a chat request adds: its template renders the whole message in one call.
    from kvserve.model.tokenizer import Tokenizer

    message = [{"role": "user", "content": decoded["prompt"]}]
    tok = Tokenizer(tokenizer)
    t = time.perf_counter()
    tok.apply_chat_template(message, add_generation_prompt=True)
    template_s = time.perf_counter() - t
    kinds = {}
    for kind in ("completions", "chat"):
        rs = [r for r in runs if r["kind"] == kind]
        health = [t for r in rs for t in r["health_s"]]
        other = [t for r in rs for t in r["other_s"]]
        kinds[kind] = {
            "statuses": [r["status"] for r in rs],
            "seconds": [r["seconds"] for r in rs],
            "health_ms": ms_stats(health),
            "other_client_ms": ms_stats(other),
            "rss_peak": max(r["rss_peak"] for r in rs),
            "rss_after_each": [r["rss_after"] for r in rs],
        }
    return {
        "max_body_bytes": limit,
        "one_byte_over_status": over,
        "health_idle_ms": ms_stats(idle_health),
        "other_client_idle_ms": ms_stats(idle_other),
        "rss_before": before,
        "rss_after": after,
        "rss_after_over_before": after / before,
        "join_64mib_ms": join_s * 1e3,
        "json_decode_64mib_ms": decode_s * 1e3,
        "chat_template_64mib_ms": template_s * 1e3,
        "loadavg_1m": os.getloadavg()[0],
        "kinds": kinds,
    }


def ms_stats(xs: list[float]) -> dict:
    return {
        "n": len(xs),
        "p50": pct(xs, 0.5) * 1e3,
        "p99": pct(xs, 0.99) * 1e3,
        "max": max(xs) * 1e3 if xs else float("nan"),
        "over_50ms": sum(x > 0.05 for x in xs),
    }


MAXIMAL_TABLE_HEAD = (
    "| requests (64 MiB bodies) | answers | latency p50 s | /health p50 / p99 / max ms (probes) "
    "| other client p50 / max ms (requests) | RSS peak | RSS after each |\n"
    "|---|---|---:|---:|---:|---:|---:|"
)


def maximal_markdown(m: dict, repeats: int) -> str:
    mib = lambda x: f"{x / (1 << 20):.0f}"  # noqa: E731
    limit = m["max_body_bytes"]
    hi, oi = m["health_idle_ms"], m["other_client_idle_ms"]
    answers = ", ".join(sorted({str(s) for k in m["kinds"].values() for s in k["statuses"]}))
    slow = sum(k["health_ms"]["over_50ms"] for k in m["kinds"].values())
    probes = sum(k["health_ms"]["n"] for k in m["kinds"].values())
    rows = [
        f"| idle (before) | - | - | {hi['p50']:.1f} / {hi['p99']:.1f} / {hi['max']:.0f} "
        f"({hi['n']}) | {oi['p50']:.0f} / {oi['max']:.0f} ({oi['n']}) | - "
        f"| {mib(m['rss_before'])} |"
    ]
    for kind, k in m["kinds"].items():
        h, o = k["health_ms"], k["other_client_ms"]
        statuses = Counter(str(s) for s in k["statuses"])
        rows.append(
            f"| {kind}, {len(k['statuses'])} x | "
            + ", ".join(f"{n} x {s}" for s, n in statuses.items())
            + f" | {pct(k['seconds'], 0.5):.2f} | {h['p50']:.1f} / {h['p99']:.1f} / "
            f"{h['max']:.0f} ({h['n']}) | {o['p50']:.0f} / {o['max']:.0f} ({o['n']}) | "
            f"{mib(k['rss_peak'])} | {', '.join(mib(x) for x in k['rss_after_each'])} |"
        )
    return f"""
## Maximal request

The same router, before the bursts: fresh, then warmed up (a short prompt, a 300,000-character
prompt tokenized on its worker thread, a short chat). Its largest request by default is
`max_body_bytes` = {limit:,} bytes (64 MiB): bodies of exactly that size are read, routed and
answered ({answers}); one byte more, declared in Content-Length, is answered
{m["one_byte_over_status"]} before the body is read.

A maximal request fills those 64 MiB with one completions prompt, or one chat message, of
text with ~11.6 characters per token. The fake engines report no context length, so the
router tokenizes up to its default cap, 131,072 tokens (~1.5M characters, on a worker thread,
8,192 characters per tokenizer call), then hashes them, and decodes and forwards the rest.
{repeats} of each, one at a time. While each runs (from its first byte sent to its answer),
/health is probed every 20 ms and another client (its own thread) sends small completions
(0.1 s in the engine), 0.05 s apart; "idle": the same for 5 s before. RSS of the router
process, MiB: before (after the warm-up), peak while the requests of a kind ran, and 1 s
after each.

{MAXIMAL_TABLE_HEAD}
{chr(10).join(rows)}

- RSS before the maximal requests {mib(m["rss_before"])} MiB, after all of them
  {mib(m["rss_after"])} MiB: after / before = {m["rss_after_over_before"]:.3f}.
- /health during the maximal requests: {slow} of {probes} probes took over 50 ms (load average
  {m["loadavg_1m"]:.1f} on this machine's cores). For scale, the work done on a whole body at
  once while holding the GIL, timed alone in this process:
  joining 64 MiB of read chunks {m["join_64mib_ms"]:.0f} ms and decoding its JSON
  {m["json_decode_64mib_ms"]:.0f} ms (msgspec) on the event loop, and for chat, rendering the
  template around the 64 MiB message {m["chat_template_64mib_ms"]:.0f} ms (on the worker
  thread, one call). The tokenizer calls on the worker thread (8,192 characters each) give
  the GIL back between them.
- Found by this measurement and fixed (2026-12-01, the same benchmark against the router
  before the fix): each client connection kept its last request's body (the body chunks, in
  a reference cycle with the HTTP parser, freed only by a full garbage collection), so RSS
  after each maximal request was 117, 185, 249 MiB (completions) then 312, 311, 313 MiB
  (chat) from 49 MiB before (after / before 6.4), peaks 441 / 506 MiB. And a long prompt's
  tokens were a list of 131,072 Python ints (~5 MiB of small objects) whose allocator arenas
  stayed pinned after the request: +4 to 6 MiB (8-12%) after the first maximal requests; now
  they fill a uint32 array a chunk at a time.
"""


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
    ap.add_argument(
        "--maximal-repeats", type=int, default=3, help="maximal requests of each kind (0: none)"
    )
    ap.add_argument("--tokenizer", help="the router's tokenizer (default: the tiny preset's)")
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
    defaults = RouterConfig()
    tmp = tempfile.TemporaryDirectory()
    try:
        tokenizer = args.tokenizer
        if tokenizer is None:
            from kvserve.model.presets import make_model

            tokenizer = str(make_model(Path(tmp.name) / "tiny", preset="tiny"))
        ports = json.loads(engines.stdout.readline())["ports"]
        rport = free_port()
        cmd = [sys.executable, "-m", "kvserve.cli", "route", "--port", str(rport)]
        cmd += ["--tokenizer", tokenizer]
        for p in ports:
            cmd += ["--endpoint", f"http://127.0.0.1:{p},model={MODEL}"]
        router = subprocess.Popen(cmd)
        wait_healthy(f"http://127.0.0.1:{rport}/health", router)
        t0 = time.time()
        maximal = None
        if args.maximal_repeats > 0:
            maximal = measure_maximal(
                rport, router.pid, defaults.max_body_bytes, args.maximal_repeats, tokenizer
            )
            maximal["took_s"] = time.time() - t0
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
        tmp.cleanup()

    capacity = 2 * (defaults.max_connections_per_endpoint + defaults.max_queue_per_endpoint)
    first_shed = next((r["concurrency"] for r in rows if r["shed"] > 0), None)
    last_queued = max(
        (r["concurrency"] for r in rows if r["shed"] == 0 and r["concurrency"] < (first_shed or 0)),
        default=None,
    )
    # Larger bursts served whole all the same (what the engines finish while a burst arrives
    # varies with the machine's load).
    also_whole = [
        r["concurrency"]
        for r in rows
        if r["shed"] == 0 and first_shed and r["concurrency"] > first_shed
    ]
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
        "maximal_request": maximal,
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
        + (
            f" Larger bursts served whole all the same: {', '.join(f'{c:,}' for c in also_whole)}."
            if also_whole
            else ""
        )
        if first_shed and last_queued
        else "- No burst of this sweep crossed the queueing capacity.",
        f"- Endpoint ejections over the whole run: {record['ejections']}; 502 answers: "
        f"{'some' if record['any_502'] else 'none'}.",
    ]
    phases = f"bursts {took:.0f} s"
    if maximal:
        phases = f"maximal requests {maximal['took_s']:.0f} s, " + phases
    md = f"""# Router overload (`kvserve route`, default limits)

`.venv/bin/python benchmarks/bench_router_overload.py` ({time.strftime("%Y-%m-%d")}: {phases}).
Load generator, router and fake engines share the machine's cores; the router tokenizes
prompts with the tiny preset's tokenizer (`--tokenizer`).

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
{maximal_markdown(maximal, args.maximal_repeats) if maximal else ""}"""
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
