"""The README's first command, small: `kvserve demo` brings up two engines and a router twice,
replays the workload through each, and writes its report."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_runs_end_to_end_and_writes_its_report(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "demo", "--model-dir", str(tiny_model_dir)]
        + ["--sessions", "3", "--turns", "2", "--first-len", "64", "--output-len", "4"]
        + ["--concurrency", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = (out / "demo.md").read_text()
    assert "round" in report.lower() and "|" in report  # the comparison table
    assert list(out.glob("*.png"))
