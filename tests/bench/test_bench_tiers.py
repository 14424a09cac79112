"""The storage-tier benchmark's quickest mode end to end (tiny model, real disk/fs tiers and a
real Valkey server): every measurement runs, serves its prompts from the tier it names, and
writes its JSON, Markdown and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_tiers_quick(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_tiers.py"),
            "--quick",
            "--model",
            str(tiny_model_dir),
            "--tier-dir",
            str(tmp_path / "tiers"),
            "--results-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,  # ~45 s on an idle 2-core box; generous for a loaded CI machine
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads((out / "tiers_quick.json").read_text())
    # 1: every tier served the prompt (the benchmark asserts the tier's hits) faster than a
    # recompute of 1024 tokens; 3: its reads against raw reads of the same bytes, interleaved.
    for run in ("disk", "fs", "fs-cold", "redis"):
        row = res["ttft"][run]
        assert row["speedup"] > 1.0, (run, row)
        assert row["read_median_GB_s"] > 0
        rd = res["read"][run]
        assert rd["ratio_median"] > 0 and len(rd["ratios"]) == len(rd["GB_s"]["tier"]), rd
    # 2: instance B loaded A's prompt through each shared tier.
    assert res["cross"]["fs"]["speedup"] > 1.0 and res["cross"]["redis"]["speedup"] > 1.0
    # 4: the engine's own stores reached every tier; the heavy stream was fed meanwhile.
    own = res["decode"]["own"]["runs_on"][0]
    assert all(n > 0 for n in own["written_after_drain"].values()), own
    assert res["decode"]["heavy"]["runs_on"][0]["fed_chunks"] > 0
    # 4w: adjacent windows with the stream on / off were paired; the on windows fed every tier.
    w = res["windows"]
    assert w["pairs"] > 0 and 0 < w["pairs_kept"] == len(w["ratios"]) <= w["pairs"], w
    assert w["fed_chunks"] > 0 and all(x > 0 for x in w["written_MB_s_on"].values()), w
    lo, hi = w["paired_ci95"]
    assert 0 < lo <= w["paired_median"] <= hi
    # 4c: the loop ran beside each writer setting and the feeder's chunks were written.
    for c in ("thread", "proc"):
        assert res["cost"][c]["loop_ratio"] > 0 and res["cost"][c]["chunks_per_s"] > 0, c
    # 4v: each server setting stored one maxmemory of chunks per phase, at the stream's rate.
    for arm in ("reuse", "glibc-defaults"):
        for phase in ("fill", "first-turnover", "steady"):
            row = res["valkey"]["median"][arm][phase]
            assert row["MB_s"] > 0 and row["cpu_ms_per_chunk"] > 0, (arm, phase, row)
    # 5: with the disk tier, re-used working-set prompts hit; without it they miss (4x host).
    top = res["hitrate"]["points"][-1]
    assert top["reuse"] == 1.0
    assert top["on"]["hit_rate"] > 0.9 and top["on"]["disk_hit_rate"] > 0.5
    assert top["off"]["hit_rate"] < top["on"]["hit_rate"]
    assert (out / "tiers_quick.png").stat().st_size > 0
    md = (out / "tiers_quick.md").read_text()
    assert "| 1. TTFT 1024 tokens, recompute / from `disk` |" in md
