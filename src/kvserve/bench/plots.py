"""PNG plots of benchmark runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from kvserve.bench.records import RequestRecord  # noqa: E402
from kvserve.bench.report import Summary  # noqa: E402


def _cdf(ax, values: list[float], label: str | None = None) -> None:
    if not values:
        return
    v = np.sort(np.asarray(values))
    ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=label)


def token_times(records: list[RequestRecord]) -> list[float]:
    """Times (seconds after the run started) of every streamed token chunk."""
    out = []
    for r in records:
        if r.ttft is None:
            continue
        t = r.start_time + r.ttft
        out.append(t)
        for gap in r.itl:
            t += gap
            out.append(t)
    return out


def _throughput_series(records: list[RequestRecord], bin_s: float = 1.0):
    times = token_times(records)
    if not times:
        return np.array([]), np.array([])
    if not any(r.itl for r in records):  # offline runs: tokens spread over first..last token
        times = []
        for r in records:
            if r.ttft is None or r.e2e is None:
                continue
            times += list(np.linspace(r.start_time + r.ttft, r.start_time + r.e2e, r.output_tokens))
    edges = np.arange(0.0, max(times) + bin_s, bin_s)
    counts, _ = np.histogram(times, bins=edges)
    return edges[:-1], counts / bin_s


def plot_run(records: list[RequestRecord], path: str | Path, title: str = "") -> Path:
    """Four panels: TTFT CDF, ITL (or TPOT) histogram, TTFT over time, output tokens/s."""
    ok = [r for r in records if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    _cdf(ax, [r.ttft for r in ok if r.ttft is not None])
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax = axes[0][1]
    itl = [x * 1000 for r in ok for x in r.itl]
    if itl:
        ax.hist(itl, bins=50)
        ax.set_xlabel("inter-token latency (ms)")
    else:
        ax.hist([t * 1000 for r in ok if (t := r.tpot) is not None], bins=50)
        ax.set_xlabel("time per output token (ms)")
    ax.set_ylabel("count")
    ax.set_title("Decode latency")
    ax = axes[1][0]
    ax.scatter(
        [r.start_time for r in ok if r.ttft is not None],
        [r.ttft for r in ok if r.ttft is not None],
        s=6,
        label="completed",
    )
    bad = [r for r in records if not r.ok]
    if bad:
        ax.scatter(
            [r.start_time for r in bad], [0] * len(bad), s=12, c="red", marker="x", label="failed"
        )
        ax.legend()
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT by send time")
    ax.grid(alpha=0.3)
    ax = axes[1][1]
    x, y = _throughput_series(ok)
    if len(x):
        ax.plot(x, y)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_comparison(
    runs: list[tuple[Summary, list[RequestRecord]]], path: str | Path, title: str = ""
) -> Path:
    """Side by side: output throughput bars, TTFT p50/p90 bars, TTFT CDFs."""
    labels = [s.label for s, _ in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    ax.bar(labels, [s.output_throughput for s, _ in runs])
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput")
    ax.tick_params(axis="x", rotation=20)
    ax = axes[1]
    x = np.arange(len(runs))
    w = 0.38
    ax.bar(x - w / 2, [s.ttft.p50 if s.ttft else 0 for s, _ in runs], w, label="p50")
    ax.bar(x + w / 2, [s.ttft.p90 if s.ttft else 0 for s, _ in runs], w, label="p90")
    ax.set_xticks(x, labels, rotation=20)
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT")
    ax.legend()
    ax = axes[2]
    for s, recs in runs:
        _cdf(ax, [r.ttft for r in recs if r.ok and r.ttft is not None], s.label)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
