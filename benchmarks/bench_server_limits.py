"""Engine server limits: the largest request `kvserve serve` accepts by default, /health while
a maximal request is tokenized, and memory before and after it.

Two real `kvserve serve` processes on the tiny preset with 65,536 positions (same weights; a
longer context lets a prompt of millions of characters pass the character bound, so it is
really tokenized and refused only by its token count, the most work one request can cause):

- ``worker``: the defaults (large inputs tokenized in a worker process);
- ``inline``: ``--tokenizer-workers 0``, tokenization on the event loop as before (the
  baseline, same run).

For each: the body-size limit probed at its edge (8 MiB read, one byte more 413); /health
latency idle, then while maximal requests (one prompt filling the 8 MiB body, sparse in tokens
so that it is tokenized whole) run, probed every 20 ms; a small completion from another client
meanwhile; 8 MiB of prose (refused from a prefix); the server's RSS (and its worker's) after a
warm-up, at its peak, and settled afterwards.

    .venv/bin/python benchmarks/bench_server_limits.py   # ~2-3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvserve.bench.machine import describe_machine, machine_markdown
from kvserve.server.tokenizer_worker import PREFIX_FACTOR

RESULTS = Path(__file__).resolve().parent / "results"
MAX_MODEL_LEN = 65536  # positions of the served model (the tiny preset's weights)
TABLE_HEAD = (
    "| server | maximal request | 8 MiB prose | 8 MiB sparse | /health idle p50 / p99 ms "
    "| /health during p50 / p99 / max ms (probes) | other client p50 / max ms "
    "| RSS before | RSS peak | RSS after | after / before |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)
TEXT = "The history of the world is long, and the quick brown fox jumps over all of it. "
# ~11.6 characters per token with the tiny vocabulary: too sparse in tokens for the prefix
# check (tokenizer_worker.PREFIX_FACTOR), so such a prompt is tokenized whole: the most work.
SPARSE = " mathematician grandmother wavelengths experiments clockmaker carefully Wednesday"


def make_long_model(root: Path) -> Path:
    from kvserve.model.presets import make_model

    model = make_model(root / "tiny", preset="tiny")
    out = root / "tiny-long"
    shutil.copytree(model, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = MAX_MODEL_LEN
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def start(model: Path, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            "0",
            "--num-kv-blocks",
            "64",
            *args,
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"on (http://\S+)", line):
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain
            return proc, m.group(1)
    raise RuntimeError("kvserve serve did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def memory(pid: int) -> dict[str, int]:
    return {"server": rss(pid), "workers": sum(rss(c) for c in children(pid))}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


_HEAD, _TAIL = b'{"max_tokens": 1, "prompt": "', b'"}'


def body_of_size(size: int, unit: str = SPARSE) -> bytes:
    """A completions body of exactly ``size`` bytes: one text prompt filling it."""
    return body_of_text(size - len(_HEAD) - len(_TAIL), unit)


def body_of_text(chars: int, unit: str = SPARSE) -> bytes:
    """A completions body whose prompt is ``chars`` characters of ``unit`` repeated."""
    return _HEAD + (unit * (chars // len(unit) + 1))[:chars].encode() + _TAIL


def probe_health(http: httpx.Client, seconds: float) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        http.get("/health").raise_for_status()
        out.append(time.perf_counter() - t)
        time.sleep(0.02)
    return out


def timed_post(http: httpx.Client, body: bytes) -> tuple[float, dict]:
    t = time.perf_counter()
    resp = http.post("/v1/completions", content=body)
    return time.perf_counter() - t, resp.json()["error"]


def run_server(model: Path, label: str, args: list[str], limit: int, repeats: int) -> dict:
    proc, url = start(model, *args)
    try:
        http = httpx.Client(base_url=url, timeout=300)
        # Warm up prefill and decode (the first steps allocate) and start the worker.
        for prompt in (TEXT * 60, "Hi there", "Hello"):
            body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}
            http.post("/v1/completions", json=body).raise_for_status()
        idle = probe_health(http, 5.0)
        mem_before = memory(proc.pid)
        # The edge of the body limit.
        over = http.post("/v1/completions", content=body_of_size(limit + 1))
        at = http.post("/v1/completions", content=body_of_size(limit))
        at_error = at.json()["error"]
        # The most tokenization work: sparse text of 4 x 16 x max_model_len characters is
        # judged by its first 16 x max_model_len (too few tokens to refuse it), then whole.
        maximal = body_of_text(4 * PREFIX_FACTOR * MAX_MODEL_LEN)
        prose_s, prose_err = timed_post(http, body_of_size(limit, TEXT))
        sparse_s, sparse_err = timed_post(http, body_of_size(limit))
        busy: list[float] = []
        others: list[float] = []
        durations: list[float] = []
        peak = dict(mem_before)
        for _ in range(repeats):
            done = threading.Event()
            result: dict = {}

            def send(result: dict = result, done: threading.Event = done) -> None:
                t = time.perf_counter()
                with httpx.Client(base_url=url, timeout=300) as c:
                    result["status"] = c.post("/v1/completions", content=maximal).status_code
                result["s"] = time.perf_counter() - t
                done.set()

            threading.Thread(target=send).start()
            time.sleep(0.3)  # the body is sent; tokenization under way
            n = 0
            while not done.is_set():
                t = time.perf_counter()
                http.get("/health").raise_for_status()
                busy.append(time.perf_counter() - t)
                n += 1
                if n % 10 == 1:
                    t = time.perf_counter()
                    r = http.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 2})
                    r.raise_for_status()
                    others.append(time.perf_counter() - t)
                m = memory(proc.pid)
                peak = {k: max(peak[k], m[k]) for k in peak}
                time.sleep(0.02)
            assert result["status"] == 400, result
            durations.append(result["s"])
        time.sleep(2.0)  # the worker trims its heap after answering
        mem_after = memory(proc.pid)
        http.close()
    finally:
        stop(proc)
    total_before = sum(mem_before.values())
    total_after = sum(mem_after.values())
    return {
        "label": label,
        "args": args,
        "limit_bytes": limit,
        "one_byte_over": over.status_code,
        "at_limit": at.status_code,
        "at_limit_error_code": at_error.get("code"),
        "maximal_request_chars": 4 * PREFIX_FACTOR * MAX_MODEL_LEN,
        "maximal_request_s": durations,
        "prose_8mib_s": prose_s,
        "prose_8mib_error": prose_err["message"],
        "sparse_8mib_s": sparse_s,
        "sparse_8mib_error": sparse_err["message"],
        "health_idle_ms": {
            "n": len(idle),
            "p50": pct(idle, 0.5) * 1e3,
            "p99": pct(idle, 0.99) * 1e3,
        },
        "health_busy_ms": {
            "n": len(busy),
            "p50": pct(busy, 0.5) * 1e3,
            "p99": pct(busy, 0.99) * 1e3,
            "max": max(busy) * 1e3 if busy else float("nan"),
        },
        "other_client_completion_ms": {
            "n": len(others),
            "p50": pct(others, 0.5) * 1e3,
            "max": max(others) * 1e3 if others else float("nan"),
        },
        "rss_bytes": {"before": mem_before, "peak": peak, "after": mem_after},
        "rss_after_over_before": total_after / total_before,
    }


def mib(x: int) -> str:
    return f"{x / (1 << 20):.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="maximal requests per server")
    ap.add_argument("--out", default=str(RESULTS / "server_limits"))
    args = ap.parse_args()
    from kvserve.config import ServerConfig

    limit = ServerConfig().max_request_body_bytes
    machine = describe_machine()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_long_model(Path(tmp))
        runs = [
            run_server(model, "worker (default)", [], limit, args.repeats),
            run_server(
                model,
                "inline (--tokenizer-workers 0)",
                ["--tokenizer-workers", "0"],
                limit,
                args.repeats,
            ),  # fmt: skip
        ]
    machine["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    record = {"date": time.strftime("%Y-%m-%d"), "machine": machine, "runs": runs}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")

    rows = []
    for r in runs:
        h0, h1, o = r["health_idle_ms"], r["health_busy_ms"], r["other_client_completion_ms"]
        b, p, a = (r["rss_bytes"][k] for k in ("before", "peak", "after"))
        rows.append(
            f"| {r['label']} | {statistics.median(r['maximal_request_s']):.1f} s | "
            f"{r['prose_8mib_s']:.2f} s | {r['sparse_8mib_s']:.2f} s | "
            f"{h0['p50']:.1f} / {h0['p99']:.1f} | {h1['p50']:.1f} / {h1['p99']:.1f} / "
            f"{h1['max']:.0f} ({h1['n']}) | {o['p50']:.0f} / {o['max']:.0f} | "
            f"{mib(b['server'])} + {mib(b['workers'])} | {mib(p['server'])} + "
            f"{mib(p['workers'])} | {mib(a['server'])} + {mib(a['workers'])} | "
            f"{r['rss_after_over_before']:.3f} |"
        )
    w = runs[0]
    md = f"""# Engine server limits (`kvserve serve`)

`.venv/bin/python benchmarks/bench_server_limits.py` ({record["date"]}).

## Machine
{machine_markdown(machine)}
## Largest request accepted by default

`--max-request-body-bytes` defaults to {limit:,} bytes (8 MiB): a body of exactly that size
is read (here {w["at_limit"]}, `{w["at_limit_error_code"]}`: refused by its token count after
it was tokenized), one byte more is {w["one_byte_over"]} (refused from its Content-Length,
before it is read). Before tokenizing, a text prompt is refused when it has more characters
than `max_model_len` tokens can hold (max_model_len x longest token x 4: 303,104 characters
for the tiny preset's 2,048 positions), and a text over 32 x max_model_len characters is
refused as soon as a prefix of 16 x max_model_len characters (then 4x, 16x, ...) alone is
2 x max_model_len tokens.

## /health and another client while a maximal request is tokenized

The tiny preset with 65,536 positions, so that prompts of megabytes pass the character bound
(9.7M characters) and are really tokenized. Token counts of prompts of words of ~11.6
characters per token ("sparse"; prose has ~4):

- maximal request: 4,194,304 characters of sparse text, the most tokenization work one
  request can cause here: its first 1,048,576 characters are too few tokens (~90k, under 2 x
  65,536) to refuse it, so it is tokenized whole (~362k tokens), then refused
  ({args.repeats} times per server);
- 8 MiB sparse (the largest body): refused from its first 4,194,304 characters;
- 8 MiB prose: refused from its first 1,048,576 characters.

/health is probed every 20 ms while the maximal request runs (and for 5 s idle before, same
server); another client sends a small completion every 10th probe. "worker" is the default
(large inputs tokenized in a worker process); "inline" tokenizes on the event loop
(`--tokenizer-workers 0`, where the server tokenized before). Memory: RSS of the server
process + its tokenizer worker, MiB, after a warm-up (prefill and decode), peak while the
maximal requests ran, and 2 s after the last.

{TABLE_HEAD}
{chr(10).join(rows)}

The worker's peak is the tokenizer's own (its encoding of ~362k tokens); the worker trims its
heap (malloc_trim) once a large job is answered. The server process holds the body and the
decoded text only while the request lasts, and trims after bodies over 1 MiB.
"""
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
