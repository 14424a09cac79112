"""The fs read benchmark end to end, a few rounds on a few chunks: every kind of read runs and
returns every chunk verified (the benchmark asserts it), and the report is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_fs_read_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_fs_read.py"), "--rounds", "2",
         "--chunks", "6", "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads((tmp_path / "fs_read.json").read_text())
    assert res["native_hash"] is True
    for kind in ("plain", "c", "python", "c_busy", "python_busy"):
        assert len(res["GB_s"][kind]) == 2 and all(x > 0 for x in res["GB_s"][kind])
    assert "C read / Python read" in (tmp_path / "fs_read.md").read_text()
