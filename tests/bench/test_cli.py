"""`kvserve bench` end to end against the local OpenAI-shaped server."""

from __future__ import annotations

import json

from kvserve.cli import main

QUIET = ["--no-progress", "--warmup", "1"]


def test_serve_prefix_groups_writes_a_report(fake, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(
        ["bench", "serve", "--target", fake.url, "--workload", "prefix-groups"]
        + ["--num-groups", "3", "--users-per-group", "3", "--prefix-len", "32"]
        + ["--question-len", "4", "--output-len", "3", "--vocab-size", "500"]
        + ["--concurrency", "1", "--out", str(out), "--no-plots"]  # plots: test_report.py
        + QUIET
    )
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    (run,) = doc["runs"]
    s = run["summary"]
    assert s["completed"] == 9 and s["failed"] == 0 and s["output_tokens"] == 27
    # Users after the first of each group hit its 32-token prefix: 6 x 32 of 9 x 36 tokens.
    assert s["cached_tokens"] >= 6 * 32
    assert run["config"]["model"] == "fake-model"
    assert {r["group"] for r in run["requests"]} == {0, 1, 2}
    md = (out / "results.md").read_text()
    assert "output throughput" in md and "prefix cache hit ratio" in md
    assert "TTFT p90" in capsys.readouterr().out
    # The warmup (1 request) was sent but not measured.
    assert len(fake.state.received) == 10


def test_make_trace_then_replay(fake, tmp_path):
    trace = tmp_path / "t.jsonl"
    rc = main(
        ["bench", "make-trace", str(trace), "--workload", "system-prompt"]
        + ["--num-system-prompts", "2", "--num-users", "5", "--system-prompt-len", "16"]
        + ["--question-len", "4", "--output-len", "2", "--vocab-size", "300"]
        + ["--request-rate", "50"]
    )
    assert rc == 0
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 5 and all(len(x["prompt_token_ids"]) == 20 for x in lines)
    sent = tmp_path / "sent.jsonl"
    rc = main(
        ["bench", "serve", "--target", fake.url, "--workload", "trace", "--trace", str(trace)]
        + ["--time-scale", "0.5", "--save-trace", str(sent), "--vocab-size", "300"]
        + QUIET
    )
    assert rc == 0
    replayed = [json.loads(x) for x in sent.read_text().splitlines()]
    assert sorted(r["prompt_token_ids"] for r in replayed) == sorted(
        x["prompt_token_ids"] for x in lines
    )


def test_throughput_two_targets_reports_ratios(fake, capsys):
    rc = main(
        ["bench", "throughput", "--target", f"a={fake.url}", "--target", f"b={fake.url}"]
        + ["--num-prompts", "4", "--input-len", "8", "--output-len", "3", "--vocab-size", "300"]
        + QUIET
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "| metric | a | b | b vs a |" in out
    # 2 runs x (1 warmup + 4 requests)
    assert len(fake.state.received) == 10


def test_multi_turn_chat(fake, tmp_path):
    out = tmp_path / "o"
    rc = main(
        ["bench", "serve", "--target", fake.url, "--model", "fake-model", "--api", "chat"]
        + ["--workload", "multi-turn", "--num-sessions", "2", "--num-turns", "3"]
        + ["--first-len", "6", "--user-len", "2", "--output-len", "2", "--think-time", "0"]
        + ["--request-rate", "100", "--out", str(out)]
        + QUIET
    )
    assert rc == 0
    s = json.loads((out / "results.json").read_text())["runs"][0]["summary"]
    assert s["completed"] == 6
    assert max(len(b["messages"]) for b in fake.state.received) == 5
    port = fake.url.rsplit(":", 1)[1]
    assert [p.name for p in out.glob("*.png")] == [f"results_127.0.0.1_{port}.png"]


def test_token_workload_without_vocabulary_is_a_clear_error(fake, capsys):
    import pytest

    with pytest.raises(SystemExit, match="--tokenizer"):
        main(["bench", "serve", "--target", fake.url] + QUIET)
