"""The fs read benchmark end to end, a few rounds on a few chunks, bare and through an engine's
storage worker: every kind of read runs and returns every chunk verified (the benchmark
asserts it), and the report is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("engine", [False, True], ids=["bare", "engine"])
def test_bench_fs_read_runs(tmp_path: Path, engine: bool) -> None:
    extra = ["--engine", "--engine-prompt", "512"] if engine else ["--chunks", "6"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_fs_read.py"), "--rounds", "2",
         "--results-dir", str(tmp_path), *extra],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    name = "fs_read_engine" if engine else "fs_read"
    res = json.loads((tmp_path / f"{name}.json").read_text())
    assert res["chunks"] == (8 if engine else 6)
    assert res["native_hash"] is True
    for kind in ("plain", "c", "python", "c_busy", "python_busy"):
        assert len(res["GB_s"][kind]) == 2 and all(x > 0 for x in res["GB_s"][kind])
    assert "C read / Python read" in (tmp_path / f"{name}.md").read_text()
