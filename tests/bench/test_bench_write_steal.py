"""The write-steal probe end to end, short: every arm runs in every round, the write and copy
arms move bytes at their pace, the written file is removed, and the report is written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_write_steal_runs(tmp_path: Path) -> None:
    # O_DIRECT: a disk-backed directory, as the benchmark's default (tmp_path may be a tmpfs)
    data = Path(tempfile.mkdtemp(prefix="kvserve-test-write-steal-", dir="/var/tmp"))
    try:
        _run(tmp_path, data)
    finally:
        shutil.rmtree(data)


def _run(tmp_path: Path, data: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_write_steal.py"), "--rounds", "3",
         "--arm-s", "0.3", "--mb-s", "50", "--dir", str(data), "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads((tmp_path / "write_steal.json").read_text())
    for arm in ("idle", "write", "memcpy"):
        assert len(res["rows"][arm]) == 3
    assert res["median"]["idle"]["MiB_s"] == 0
    for arm in ("write", "memcpy"):
        assert 25 < res["median"][arm]["MiB_s"] <= 55
    assert not list(data.iterdir())
    assert "write minus memcpy" in (tmp_path / "write_steal.md").read_text()
