"""Report statistics on known inputs, Markdown ratios, and the written files."""

from __future__ import annotations

import json

import pytest

from kvserve.bench.records import RequestRecord
from kvserve.bench.report import Run, Stat, markdown_table, summarize, write_report


def test_stat_percentiles_known_values():
    s = Stat.of([float(i) for i in range(1, 101)])
    assert s.count == 100 and s.mean == 50.5 and s.min == 1 and s.max == 100
    assert s.p50 == pytest.approx(50.5)
    assert s.p90 == pytest.approx(90.1)
    assert s.p99 == pytest.approx(99.01)
    assert Stat.of([]) is None


def _rec(i, ttft, e2e, out, prompt=100, cached=None, itl=(), error=None, endpoint=None):
    return RequestRecord(
        f"r{i}",
        start_time=float(i),
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=out,
        ttft=ttft,
        e2e=e2e,
        itl=list(itl),
        error=error,
        endpoint=endpoint,
    )


def test_summarize_counts_completed_only():
    recs = [
        _rec(0, 0.1, 1.1, 11, cached=50, itl=[0.1] * 10, endpoint="a"),
        _rec(1, 0.3, 2.3, 21, cached=0, itl=[0.1] * 20, endpoint="b"),
        _rec(2, 0.2, 0.2, 1, cached=None, endpoint="a"),
        _rec(3, None, None, 0, error="HTTP 400: prompt 1234 too long"),
        _rec(4, None, None, 0, error="HTTP 400: prompt 99 too long"),
        _rec(5, None, None, 0, error="ConnectError: refused"),
    ]
    s = summarize(recs, duration=10.0, label="x")
    assert (s.num_requests, s.completed, s.failed) == (6, 3, 3)
    assert s.prompt_tokens == 300 and s.output_tokens == 33
    assert s.request_throughput == pytest.approx(0.3)
    assert s.output_throughput == pytest.approx(3.3)
    assert s.prompt_throughput == pytest.approx(30.0)
    assert s.total_token_throughput == pytest.approx(33.3)
    # Only requests that reported cached tokens count: 50 / 200.
    assert s.cached_tokens == 50 and s.cache_hit_ratio == pytest.approx(0.25)
    assert s.ttft.mean == pytest.approx(0.2) and s.ttft.p50 == pytest.approx(0.2)
    # TPOT = (e2e - ttft) / (out - 1): 0.1 for both multi-token requests; none for out == 1.
    assert s.tpot.count == 2 and s.tpot.mean == pytest.approx(0.1)
    assert s.itl.count == 30
    assert s.e2e.max == pytest.approx(2.3)
    assert s.errors == {"HTTP N: prompt N too long": 2, "ConnectError: refused": 1}
    assert s.endpoints == {"a": 2, "b": 1}


def test_no_cache_reports_mean_no_ratio():
    s = summarize([_rec(0, 0.1, 0.5, 5)], 1.0)
    assert s.cache_hit_ratio is None and s.cached_tokens is None


def test_markdown_ratios_say_better_above_one():
    fast = summarize([_rec(0, 0.1, 1.0, 100)], 1.0, "fast")
    slow = summarize([_rec(0, 0.4, 4.0, 100)], 2.0, "slow")
    md = markdown_table([slow, fast], baseline="slow")
    lines = {line.split("|")[1].strip(): line for line in md.splitlines()[2:]}
    assert "fast vs slow" in md.splitlines()[0]
    assert lines["output throughput (tok/s)"].rstrip(" |").endswith("2.00x")
    assert lines["TTFT p50 (ms)"].rstrip(" |").endswith("4.00x")  # 400 ms / 100 ms
    assert "| 100.0 |" in lines["TTFT p50 (ms)"]
    assert "n/a" in lines["ITL p50 (ms)"]


def test_write_report_files(tmp_path):
    recs = [_rec(i, 0.1 + i / 100, 1.0 + i / 10, 10, cached=i, itl=[0.09] * 9) for i in range(20)]
    runs = [
        Run(summarize(recs, 5.0, "a"), recs, {"k": 1}),
        Run(summarize(recs[:10], 5.0, "b"), recs[:10]),
    ]
    machine = {"cpu_model": "test cpu", "nproc": 2, "cpu_count": 2, "memory_gib": 1.0}
    paths = write_report(tmp_path, runs, title="T", machine=machine, workload="w", baseline="a")
    doc = json.loads(paths["json"].read_text())
    assert doc["runs"][0]["summary"]["completed"] == 20
    assert len(doc["runs"][1]["requests"]) == 10 and doc["runs"][0]["config"] == {"k": 1}
    md = paths["md"].read_text()
    assert "test cpu" in md and "b vs a" in md
    pngs = [p for k, p in paths.items() if k.startswith("plot")]
    assert len(pngs) == 3
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.name in md


def test_machine_description():
    from kvserve.bench.machine import describe_machine

    m = describe_machine()
    assert m["nproc"] >= 1 and m["platform"] and m["memory_gib"] > 0
    assert m["torch"]  # installed in the project venv
