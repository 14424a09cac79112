"""Trace replay files: round trip, Mooncake-style hash ids, bad records."""

from __future__ import annotations

import json

import pytest

from kvserve.bench.arrivals import arrival_times
from kvserve.bench.trace import load_trace, workload_entries, write_trace
from kvserve.bench.workloads import Vocab, random_workload, system_prompt_workload

VOCAB = Vocab(500)


def test_round_trip_tokens(tmp_path):
    w = system_prompt_workload(3, 20, system_prompt_len=32, question_len=8, vocab=VOCAB)
    times = arrival_times(20, 5.0, seed=1)
    path = tmp_path / "t.jsonl"
    assert write_trace(path, workload_entries(w, times)) == 20
    back = load_trace(path)
    assert back.kind == "tokens" and len(back.sessions) == 20
    for s, orig, t in zip(back.sessions, w.sessions, times, strict=True):
        assert s.turns[0].user == orig.prefix + orig.turns[0].user
        assert s.turns[0].output_len == orig.turns[0].output_len
        assert s.arrival_time == pytest.approx(t, abs=1e-6)
        assert s.session_id == orig.session_id and s.group == orig.group


def test_round_trip_text_and_time_scale(tmp_path):
    w = random_workload(5, 10, 3, kind="text", seed=2)
    path = tmp_path / "t.jsonl"
    write_trace(path, workload_entries(w, [10.0, 11.0, 12.0, 13.0, 14.0]))
    back = load_trace(path, time_scale=0.5)
    assert back.kind == "text"
    assert [s.arrival_time for s in back.sessions] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert [s.turns[0].user for s in back.sessions] == [s.turns[0].user for s in w.sessions]


def test_mooncake_hash_ids_share_prefixes(tmp_path):
    recs = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 700, "output_length": 7, "hash_ids": [1, 2]},
        {"timestamp": 2500, "input_length": 600, "output_length": 9, "hash_ids": [4, 5]},
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    w = load_trace(path, vocab=VOCAB, hash_block_size=512)
    a, b, c = (s.turns[0] for s in w.sessions)  # sorted by time: 500, 1000, 2500 ms
    assert [s.arrival_time for s in w.sessions] == [0.0, 0.5, 2.0]
    assert (len(a.user), len(b.user), len(c.user)) == (700, 1100, 600)
    assert a.user == b.user[:700]  # hash ids 1, 2 -> identical tokens
    assert c.user[:512] != a.user[:512]
    assert [a.output_len, b.output_len, c.output_len] == [7, 5, 9]
    with pytest.raises(ValueError, match="vocabulary"):
        load_trace(path)


def test_bad_records_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_time": 0, "prompt": "hi", "output_len": 2}\n{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*output_len"):
        load_trace(path)
    path.write_text('{"arrival_time": 0, "output_len": 2}\n')
    with pytest.raises(ValueError, match="no prompt"):
        load_trace(path)
    path.write_text("not json\n")
    with pytest.raises(ValueError, match=":1:"):
        load_trace(path)


def test_multi_turn_workloads_need_the_loadgen():
    from kvserve.bench.workloads import multi_turn_workload

    with pytest.raises(ValueError, match="single-turn"):
        workload_entries(multi_turn_workload(2, 3, vocab=VOCAB))
