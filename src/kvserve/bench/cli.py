"""`kvserve bench`: throughput (offline or over HTTP) and serving benchmarks with workloads.

    kvserve bench throughput [--model DIR] [--num-prompts 200 --input-len 512 --output-len 128]
    kvserve bench throughput --target URL [--target LABEL=URL ...] [--model NAME]
    kvserve bench serve --target URL --workload multi-turn --request-rate 2 --out DIR
    kvserve bench serve --target URL --workload trace --trace FILE --time-scale 0.5

Without ``--target`` the throughput benchmark runs offline on a model directory (default: the
``small`` preset, created if missing). With targets, the same workload goes through each
OpenAI-compatible server in turn with the same client, and ratios against the first target
are reported. ``--out DIR`` writes ``results.json``, ``results.md`` and PNG plots.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from kvserve.bench.workloads import Vocab, Workload

# EngineConfig fields exposed as flags of the offline benchmark.
ENGINE_FLAGS = (
    "dtype",
    "device",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "num_threads",
    "kv_offload_size",
)

WORKLOADS = ("random", "multi-turn", "system-prompt", "prefix-groups", "trace")


# ---------------------------------------------------------------------------------------------
# Model directory and tokenizer


def default_model_dir(preset: str = "small", create: bool = True) -> Path:
    """``./models/<preset>`` if present, else ``~/.cache/kvserve/models/<preset>`` (created
    with :func:`kvserve.model.presets.make_model` when missing)."""
    local = Path("models") / preset
    if (local / "config.json").exists():
        return local
    cache = Path(os.path.expanduser("~/.cache/kvserve/models")) / preset
    if (cache / "config.json").exists() or not create:
        return cache
    from kvserve.model.presets import make_model

    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        target = cache
    except OSError:
        target = local
    print(f"creating the {preset!r} preset model in {target} ...", file=sys.stderr, flush=True)
    return make_model(target, preset=preset)


def tokenizer_for(path: str | Path | None):
    """``(Vocab, tokenize)`` of a model directory, or ``(None, None)``."""
    if path is None:
        return None, None
    vocab = Vocab.from_model_dir(path)
    tokenize = None
    if (Path(path) / "tokenizer.json").exists():
        from kvserve.model.tokenizer import Tokenizer

        tok = Tokenizer(path)

        def tokenize(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

    return vocab, tokenize


# ---------------------------------------------------------------------------------------------
# Arguments


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (unset values take the workload's default)")
    g.add_argument("--workload", choices=WORKLOADS, default="random")
    g.add_argument(
        "--kind",
        choices=("tokens", "text"),
        default=None,
        help="token-id or text prompts (default: text for --api chat, else tokens)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-prompts", type=int, default=None, help="random: requests")
    g.add_argument("--input-len", type=int, default=None, help="random: prompt tokens")
    g.add_argument("--output-len", type=int, default=None, help="output tokens per request")
    g.add_argument("--range-ratio", type=float, default=None, help="lengths vary +-ratio")
    g.add_argument("--num-sessions", type=int, default=None, help="multi-turn: sessions")
    g.add_argument("--num-turns", type=int, default=None, help="turns per session")
    g.add_argument("--first-len", type=int, default=None, help="multi-turn: first message")
    g.add_argument("--user-len", type=int, default=None, help="multi-turn: later messages")
    g.add_argument("--think-time", type=float, default=None, help="mean seconds between turns")
    g.add_argument("--system-prompt-len", type=int, default=None)
    g.add_argument("--num-system-prompts", type=int, default=None)
    g.add_argument("--num-users", type=int, default=None, help="system-prompt: users")
    g.add_argument("--question-len", type=int, default=None)
    g.add_argument("--num-groups", type=int, default=None, help="prefix-groups: groups")
    g.add_argument("--users-per-group", type=int, default=None)
    g.add_argument("--prefix-len", type=int, default=None, help="prefix-groups: prefix tokens")
    g.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=None,
        help="prefix-groups: size the groups to --kv-fraction of this capacity "
        "(instances x blocks x block size)",
    )
    g.add_argument("--kv-fraction", type=float, default=0.7)
    g.add_argument("--trace", default=None, help="trace: JSONL file")
    g.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrivals")
    g.add_argument("--hash-block-size", type=int, default=512, help="trace: tokens per hash id")
    g.add_argument("--max-requests", type=int, default=None, help="trace: first N records")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="model directory whose vocabulary/tokenizer token-id workloads use",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token ids in [0, N) when no --tokenizer is given",
    )


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--api", choices=("completions", "chat"), default="completions")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="open loop: sessions per second (Poisson); inf sends all at once",
    )
    g.add_argument("--burstiness", type=float, default=1.0)
    g.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop: this many users, each running sessions back to back",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="open loop: at most this many requests in flight",
    )
    g.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--min-tokens", action="store_true", help="also send min_tokens=max_tokens")
    g.add_argument(
        "--return-token-ids",
        action="store_true",
        help="ask for generated token ids (vLLM's return_token_ids) for multi-turn feedback",
    )
    g.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    g.add_argument("--header", action="append", default=[], metavar="NAME:VALUE")


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="directory for results.json/.md and plots")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--title", default=None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.config import EngineConfig, add_dataclass_args

    sub = parser.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)
    tp = sub.add_parser("throughput", help="fixed synthetic workload, offline or over HTTP")
    tp.add_argument(
        "--model",
        default=None,
        help="offline: model directory (default: the small preset); with --target: "
        "the model name sent (default: each server's first /v1/models entry)",
    )
    tp.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="[LABEL=]URL",
        help="OpenAI-compatible server (repeatable; the first is the baseline)",
    )
    add_workload_arguments(tp)
    add_load_arguments(tp)
    add_output_arguments(tp)
    eng = tp.add_argument_group("offline engine (EngineConfig)")
    skip = tuple(
        f.name for f in __import__("dataclasses").fields(EngineConfig) if f.name not in ENGINE_FLAGS
    )
    add_dataclass_args(eng, EngineConfig, skip=skip)

    sv = sub.add_parser("serve", help="a workload against a running server")
    sv.add_argument("--target", required=True, metavar="URL")
    sv.add_argument("--model", default=None, help="model name (default: from /v1/models)")
    sv.add_argument("--label", default=None)
    sv.add_argument("--save-trace", default=None, help="write the requests sent as a trace")
    add_workload_arguments(sv)
    add_load_arguments(sv)
    add_output_arguments(sv)

    mt = sub.add_parser("make-trace", help="write a single-turn workload as a JSONL trace")
    mt.add_argument("path")
    add_workload_arguments(mt)
    mt.add_argument("--request-rate", type=float, default=math.inf)
    mt.add_argument("--burstiness", type=float, default=1.0)
    mt.add_argument("--api", default="completions", help=argparse.SUPPRESS)


# ---------------------------------------------------------------------------------------------
# Building workloads from arguments


def _set(d: dict, **kw: Any) -> dict:
    d.update({k: v for k, v in kw.items() if v is not None})
    return d


def build_workload(
    args: argparse.Namespace,
    vocab: Vocab | None,
    *,
    seed: int | None = None,
    num_override: int | None = None,
) -> Workload:
    """The workload named by ``--workload`` with the flags given (``num_override`` replaces
    the request/session count, for warmups)."""
    from kvserve.bench import workloads as w

    seed = args.seed if seed is None else seed
    kind = args.kind or ("text" if args.api == "chat" else "tokens")
    common: dict[str, Any] = dict(vocab=vocab, kind=kind, seed=seed)
    name = args.workload
    n = num_override
    if name == "random":
        kw = _set(
            dict(common),
            num_prompts=n or args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
        )
        return w.random_workload(**kw)
    if name == "multi-turn":
        kw = _set(
            dict(common),
            num_sessions=n or args.num_sessions,
            num_turns=1 if n else args.num_turns,
            first_len=args.first_len,
            user_len=args.user_len,
            output_len=args.output_len,
            think_time=args.think_time,
            system_prompt_len=args.system_prompt_len,
            range_ratio=args.range_ratio,
        )
        return w.multi_turn_workload(**kw)
    if name == "system-prompt":
        kw = _set(
            dict(common),
            num_system_prompts=args.num_system_prompts,
            num_users=n or args.num_users,
            system_prompt_len=args.system_prompt_len,
            question_len=args.question_len,
            output_len=args.output_len,
            num_turns=1 if n else args.num_turns,
            think_time=args.think_time,
        )
        return w.system_prompt_workload(**kw)
    if name == "prefix-groups":
        groups, prefix_len = args.num_groups, args.prefix_len
        if args.kv_capacity_tokens:
            if groups is None and prefix_len is None:
                prefix_len = 6000
            groups, prefix_len = w.size_prefix_groups(
                args.kv_capacity_tokens,
                args.kv_fraction,
                prefix_len=None if groups is not None else prefix_len,
                num_groups=groups,
                block_size=16,
            )
        kw = _set(
            dict(common),
            num_groups=1 if n else groups,
            users_per_group=n or args.users_per_group,
            prefix_len=prefix_len,
            question_len=args.question_len,
            output_len=args.output_len,
            num_turns=1 if n else args.num_turns,
            think_time=args.think_time,
        )
        return w.prefix_groups_workload(**kw)
    if name == "trace":
        if not args.trace:
            raise SystemExit("--workload trace needs --trace FILE")
        if n:  # warmup: random requests of the same kind, not the trace's own prompts
            return w.random_workload(n, 64, 8, vocab=vocab, kind=kind, seed=seed)
        from kvserve.bench.trace import load_trace

        return load_trace(
            args.trace,
            vocab=vocab,
            hash_block_size=args.hash_block_size,
            time_scale=args.time_scale,
            max_requests=args.max_requests,
        )
    raise SystemExit(f"unknown workload {name!r}")


def _vocab_from_args(args: argparse.Namespace, model_dir: str | Path | None = None):
    if args.tokenizer:
        return tokenizer_for(args.tokenizer)
    if args.vocab_size:
        return Vocab(args.vocab_size), None
    if model_dir is not None:
        return tokenizer_for(model_dir)
    return None, None


def _headers(args: argparse.Namespace) -> dict[str, str]:
    out = {}
    for h in args.header:
        name, _, value = h.partition(":")
        out[name.strip()] = value.strip()
    return out


def _targets(values: list[str]) -> list[tuple[str, str]]:
    out = []
    for v in values:
        label, sep, url = v.partition("=")
        if not sep or "://" in label:
            label, url = v.split("://", 1)[-1].rstrip("/"), v
        out.append((label, url))
    return out


def load_config(args: argparse.Namespace, url: str, model: str, label: str):
    from kvserve.bench.loadgen import LoadConfig

    return LoadConfig(
        base_url=url,
        model=model,
        api=args.api,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        concurrency=args.concurrency,
        max_concurrency=args.max_concurrency,
        duration=args.duration,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        return_token_ids=args.return_token_ids,
        seed=args.seed,
        headers=_headers(args),
        record_trace=bool(getattr(args, "save_trace", None)),
        progress=not args.no_progress,
        label=label,
    )


# ---------------------------------------------------------------------------------------------
# Running


def _finish(
    args,
    runs,
    *,
    title: str,
    workload: Workload,
    baseline: str | None,
    stem: str = "results",
    notes: str = "",
) -> None:
    from kvserve.bench.machine import describe_machine
    from kvserve.bench.report import errors_markdown, markdown_table, write_report

    summaries = [r.summary for r in runs]
    print()
    print(f"## {title}\n\n{workload.describe()}\n")
    print(markdown_table(summaries, baseline))
    err = errors_markdown(summaries)
    if err:
        print(err)
    if args.out:
        paths = write_report(
            args.out,
            runs,
            title=title,
            machine=describe_machine(),
            workload=workload.describe(),
            baseline=baseline,
            stem=stem,
            notes=notes,
            plots=not args.no_plots,
        )
        print("wrote " + ", ".join(str(p) for p in paths.values()))


def run_http(args, workload, warmup, tokenize, url: str, model: str | None, label: str):
    """One measured HTTP run: ``(LoadResult, report.Run)``."""
    from kvserve.bench.loadgen import discover_model, http_run

    cfg = load_config(args, url, model or discover_model(url), label)
    return http_run(workload, cfg, tokenize=tokenize, warmup=warmup)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The offline engine flags given on the command line (EngineConfig fields)."""
    return {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k, None) is not None}


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "make-trace":
        return _make_trace(args)
    if args.bench_command == "throughput":
        return _throughput(args)
    return _serve(args)


def _throughput(args: argparse.Namespace) -> int:
    for flag, default in (("num_prompts", 200), ("input_len", 512), ("output_len", 128)):
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    targets = _targets(args.target)
    model_dir = None
    if not targets:
        model_dir = Path(args.model) if args.model else default_model_dir()
    tok_dir = args.tokenizer or model_dir
    if targets and tok_dir is None and not args.vocab_size:
        tok_dir = default_model_dir()  # the default served model's vocabulary
    vocab, tokenize = tokenizer_for(tok_dir) if tok_dir else (Vocab(args.vocab_size), None)
    workload = build_workload(args, vocab)
    warmup = (
        build_workload(args, vocab, seed=args.seed + 10_000, num_override=args.warmup)
        if args.warmup
        else None
    )
    runs = []
    if not targets:
        from kvserve.bench.offline import offline_run

        run_ = offline_run(
            model_dir,
            workload,
            engine_kwargs=engine_kwargs(args),
            warmup=warmup,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            tokenize=tokenize,
            progress=not args.no_progress,
        )
        runs.append(run_)
    for label, url in targets:
        _, r = run_http(args, workload, warmup, tokenize, url, args.model, label)
        runs.append(r)
    baseline = targets[0][0] if len(targets) > 1 else None
    _finish(
        args,
        runs,
        title=args.title or "kvserve bench throughput",
        workload=workload,
        baseline=baseline,
    )
    return 0 if all(r.summary.completed for r in runs) else 1


def _serve(args: argparse.Namespace) -> int:
    vocab, tokenize = _vocab_from_args(args)
    kind = args.kind or ("text" if args.api == "chat" else "tokens")
    if kind == "tokens" and vocab is None and args.workload != "trace":
        raise SystemExit(
            "token-id workloads need --tokenizer DIR or --vocab-size N (or use --kind text)"
        )
    workload = build_workload(args, vocab)
    warmup = (
        build_workload(args, vocab, seed=args.seed + 10_000, num_override=args.warmup)
        if args.warmup
        else None
    )
    label = args.label or args.target.split("://", 1)[-1].rstrip("/")
    result, r = run_http(args, workload, warmup, tokenize, args.target, args.model, label)
    if args.save_trace:
        from kvserve.bench.trace import write_trace

        n = write_trace(args.save_trace, result.sent_trace)
        print(f"wrote {n} requests to {args.save_trace}")
    _finish(
        args,
        [r],
        title=args.title or f"kvserve bench serve: {workload.name}",
        workload=workload,
        baseline=None,
    )
    return 0 if r.summary.completed else 1


def _make_trace(args: argparse.Namespace) -> int:
    from kvserve.bench.arrivals import arrival_times
    from kvserve.bench.trace import workload_entries, write_trace

    vocab, _ = _vocab_from_args(args)
    workload = build_workload(args, vocab)
    times = arrival_times(
        len(workload.sessions), args.request_rate, burstiness=args.burstiness, seed=args.seed
    )
    n = write_trace(args.path, workload_entries(workload, times))
    print(f"wrote {n} requests ({workload.describe()}) to {args.path}")
    return 0
