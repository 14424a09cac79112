"""Summaries of benchmark runs: statistics, JSON, a Markdown table, and the files of a report.

Definitions follow vLLM's ``benchmark_serving``: throughputs count completed requests only,
over the run's duration (start to the end of its last request); TPOT is
``(e2e - ttft) / (output_tokens - 1)``; ITL are the gaps between streamed token chunks;
percentiles interpolate linearly (``numpy.percentile``). The cache hit ratio is cached prompt
tokens over prompt tokens, among requests whose server reported cached tokens.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvserve.bench.records import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass
class Stat:
    """Distribution of one latency (seconds)."""

    count: int
    mean: float
    std: float
    min: float
    max: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Stat | None:
        if not values:
            return None
        a = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(x) for x in np.percentile(a, PERCENTILES))
        return cls(
            len(a), float(a.mean()), float(a.std()), float(a.min()), float(a.max()), p50, p90, p99
        )


@dataclass
class Summary:
    label: str
    num_requests: int
    completed: int
    failed: int
    duration: float
    prompt_tokens: int  # of completed requests whose prompt length is known
    output_tokens: int
    cached_tokens: int | None
    request_throughput: float
    prompt_throughput: float
    output_throughput: float
    total_token_throughput: float
    cache_hit_ratio: float | None
    ttft: Stat | None
    tpot: Stat | None
    itl: Stat | None
    e2e: Stat | None
    errors: dict[str, int] = field(default_factory=dict)
    endpoints: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _error_kind(msg: str) -> str:
    """Group error messages: digits folded so per-request details do not split kinds."""
    return re.sub(r"\d+", "N", msg)[:120]


def summarize(records: list[RequestRecord], duration: float, label: str = "") -> Summary:
    """Statistics of one run."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    with_cache = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached = sum(r.cached_tokens or 0 for r in with_cache) if with_cache else None
    cache_hit = None
    if with_cache:
        denom = sum(r.prompt_tokens or 0 for r in with_cache)
        cache_hit = (cached or 0) / denom if denom else None
    d = duration if duration > 0 else float("nan")
    return Summary(
        label=label,
        num_requests=len(records),
        completed=len(ok),
        failed=len(failed),
        duration=duration,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        cached_tokens=cached,
        request_throughput=len(ok) / d,
        prompt_throughput=prompt_tokens / d,
        output_throughput=output_tokens / d,
        total_token_throughput=(prompt_tokens + output_tokens) / d,
        cache_hit_ratio=cache_hit,
        ttft=Stat.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=Stat.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Stat.of([x for r in ok for x in r.itl]),
        e2e=Stat.of([r.e2e for r in ok if r.e2e is not None]),
        errors=dict(Counter(_error_kind(r.error or "") for r in failed).most_common()),
        endpoints=dict(sorted(Counter(r.endpoint for r in ok if r.endpoint).items())),
    )


# ---------------------------------------------------------------------------------------------
# Markdown

# (row name, getter, format, higher is better)
_ROWS: list[tuple[str, str, str, bool]] = [
    ("requests completed / sent", "_completed", "", True),
    ("duration (s)", "duration", "{:.2f}", False),
    ("request throughput (req/s)", "request_throughput", "{:.3f}", True),
    ("prompt throughput (tok/s)", "prompt_throughput", "{:.1f}", True),
    ("output throughput (tok/s)", "output_throughput", "{:.1f}", True),
    ("total token throughput (tok/s)", "total_token_throughput", "{:.1f}", True),
    ("prefix cache hit ratio", "cache_hit_ratio", "{:.1%}", True),
    ("TTFT mean (ms)", "ttft.mean", "{:.1f}", False),
    ("TTFT p50 (ms)", "ttft.p50", "{:.1f}", False),
    ("TTFT p90 (ms)", "ttft.p90", "{:.1f}", False),
    ("TTFT p99 (ms)", "ttft.p99", "{:.1f}", False),
    ("TPOT p50 (ms)", "tpot.p50", "{:.2f}", False),
    ("TPOT p90 (ms)", "tpot.p90", "{:.2f}", False),
    ("ITL p50 (ms)", "itl.p50", "{:.2f}", False),
    ("ITL p90 (ms)", "itl.p90", "{:.2f}", False),
    ("ITL p99 (ms)", "itl.p99", "{:.2f}", False),
    ("E2E p50 (s)", "e2e.p50", "{:.2f}", False),
    ("E2E p90 (s)", "e2e.p90", "{:.2f}", False),
    ("E2E p99 (s)", "e2e.p99", "{:.2f}", False),
]


def metric(summary: Summary, key: str) -> float | None:
    """A summary value by dotted key (``"ttft.p90"``); latencies of ms rows stay in seconds."""
    obj: object = summary
    for part in key.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return float(obj)  # type: ignore[arg-type]


def _cell(summary: Summary, name: str, key: str, fmt: str) -> str:
    if key == "_completed":
        return f"{summary.completed} / {summary.num_requests}"
    v = metric(summary, key)
    if v is None or v != v:
        return "n/a"
    if "(ms)" in name:
        v *= 1000.0
    return fmt.format(v)


def markdown_table(summaries: list[Summary], baseline: str | None = None) -> str:
    """One column per run; with ``baseline`` (a label), one ratio column per other run.

    Ratios are run / baseline for throughputs and baseline / run for latencies, so > 1 always
    means the run did better than the baseline.
    """
    base = next((s for s in summaries if s.label == baseline), None)
    others = [s for s in summaries if s is not base] if base is not None else []
    head = ["metric"] + [s.label or f"run {i}" for i, s in enumerate(summaries)]
    head += [f"{s.label} vs {base.label}" for s in others] if base is not None else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, key, fmt, higher in _ROWS:
        row = [name] + [_cell(s, name, key, fmt) for s in summaries]
        for s in others:
            assert base is not None
            a, b = metric(s, key), metric(base, key)
            if key.startswith("_") or a is None or b is None or not a or not b or "ratio" in name:
                row.append("")
            else:
                row.append(f"{(a / b if higher else b / a):.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def errors_markdown(summaries: list[Summary]) -> str:
    lines = []
    for s in summaries:
        for kind, n in s.errors.items():
            lines.append(f"- {s.label}: {n} x `{kind}`")
    return ("\n**Errors**\n\n" + "\n".join(lines) + "\n") if lines else ""


# ---------------------------------------------------------------------------------------------
# Report files


@dataclass
class Run:
    """One measured run: its summary and per-request records."""

    summary: Summary
    records: list[RequestRecord]
    config: dict = field(default_factory=dict)


def write_report(
    out_dir: str | Path,
    runs: list[Run],
    *,
    title: str,
    machine: dict,
    workload: str = "",
    baseline: str | None = None,
    notes: str = "",
    stem: str = "results",
    plots: bool = True,
) -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and PNG plots; returns the written paths."""
    from kvserve.bench.machine import machine_markdown

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = [r.summary for r in runs]
    paths: dict[str, Path] = {}
    if plots:
        from kvserve.bench.plots import plot_comparison, plot_run

        for i, r in enumerate(runs):
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", r.summary.label or f"run{i}")
            paths[f"plot_{name}"] = plot_run(
                r.records, out / f"{stem}_{name}.png", title=f"{title}: {r.summary.label}"
            )
        if len(runs) > 1:
            paths["plot_comparison"] = plot_comparison(
                [(r.summary, r.records) for r in runs], out / f"{stem}_comparison.png", title
            )
    doc = {
        "title": title,
        "workload": workload,
        "machine": machine,
        "baseline": baseline,
        "notes": notes,
        "runs": [
            {
                "summary": r.summary.to_json(),
                "config": r.config,
                "requests": [x.to_json() for x in r.records],
            }
            for r in runs
        ],
    }
    paths["json"] = out / f"{stem}.json"
    paths["json"].write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = [f"# {title}\n"]
    if workload:
        md.append(f"Workload: {workload}\n")
    md.append("Machine:\n\n" + machine_markdown(machine))
    md.append(markdown_table(summaries, baseline))
    md.append(errors_markdown(summaries))
    if notes:
        md.append("\n" + notes.strip() + "\n")
    for key, p in paths.items():
        if key.startswith("plot"):
            md.append(f"\n![{key}]({p.name})\n")
    paths["md"] = out / f"{stem}.md"
    paths["md"].write_text("\n".join(md))
    return paths
