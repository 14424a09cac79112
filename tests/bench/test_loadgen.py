"""The load generator against a real local HTTP server (tests/bench/conftest.py)."""

from __future__ import annotations

import time

import pytest

from kvserve.bench.arrivals import arrival_times
from kvserve.bench.loadgen import CANCELLED, LoadConfig, discover_model, run_load
from kvserve.bench.trace import load_trace, write_trace
from kvserve.bench.workloads import (
    Session,
    Turn,
    Vocab,
    Workload,
    multi_turn_workload,
    random_workload,
)

VOCAB = Vocab(1000, frozenset({0}))


def cfg(url: str, **kw) -> LoadConfig:
    kw.setdefault("progress", False)
    return LoadConfig(base_url=url, model="fake-model", **kw)


def test_measures_ttft_itl_usage_and_endpoint(fake):
    fake.state.reset(ttft=0.2, itl=0.03)
    w = random_workload(3, 20, 6, vocab=VOCAB, seed=0)
    res = run_load(w, cfg(fake.url))
    assert len(res.records) == 3
    for r in res.records:
        assert r.ok, r.error
        # A chunk cannot be read before the server sent it: lower bounds are exact; reads may
        # bunch up on a busy machine, so single gaps are not bounded below.
        assert 0.2 <= r.ttft < 5.0
        assert len(r.itl) == 5 and all(0 <= x < 5.0 for x in r.itl)
        assert r.e2e >= 0.2 + 5 * 0.03
        assert r.e2e == pytest.approx(r.ttft + sum(r.itl), abs=1e-6)
        assert r.output_tokens == 6 and r.prompt_tokens == 20 and r.cached_tokens == 0
        assert r.endpoint == "fake-0"
    body = fake.state.received[0]
    assert body["ignore_eos"] is True and body["max_tokens"] == 6 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-model" and isinstance(body["prompt"], list)
    assert res.duration >= max(r.finish_time for r in res.records) - 1e-9


def test_cached_tokens_from_usage(fake):
    s = Session("a", [Turn(list(range(1, 41)), 2)])
    t = Session("b", [Turn(list(range(1, 31)) + [999] * 10, 2)])
    res = run_load(Workload("w", [s, t]), cfg(fake.url, concurrency=1))
    assert [r.cached_tokens for r in res.records] == [0, 30]


def test_errors_are_recorded_not_raised(fake, unused_port):
    w = Workload(
        "w",
        [
            Session("ok", [Turn([5, 6, 7], 3)]),
            Session("bad", [Turn([0, 6, 7], 3)]),  # fake answers 400
        ],
    )
    res = run_load(w, cfg(fake.url, concurrency=1))
    ok, bad = sorted(res.records, key=lambda r: r.session_id != "ok")
    assert ok.ok and ok.output_tokens == 3
    assert bad.error.startswith("HTTP 400") and "rejected" in bad.error
    # Nothing listens: a connection error per request, the run still finishes.
    res = run_load(random_workload(2, 5, 2, vocab=VOCAB), cfg(f"http://127.0.0.1:{unused_port}"))
    assert len(res.records) == 2
    assert all(r.error and "Connect" in r.error for r in res.records)


def test_stream_without_done_is_an_error(fake):
    w = Workload("w", [Session("d", [Turn("DROP this", 4)])], kind="text")
    (r,) = run_load(w, cfg(fake.url)).records
    assert r.error == "stream ended without [DONE]"
    assert r.ttft is not None and r.output_tokens == 1


def test_multi_turn_chat_feeds_answers_back(fake):
    fake.state.reset(ttft=0.01, itl=0.001)
    w = multi_turn_workload(
        2, 3, first_len=5, user_len=3, output_len=2, think_time=0.1, kind="text", seed=0
    )
    res = run_load(w, cfg(fake.url, api="chat", request_rate=1000))
    assert len(res.records) == 6 and all(r.ok for r in res.records)
    by_session: dict[str, list] = {}
    for body in fake.state.received:
        by_session.setdefault(body["messages"][0]["content"], []).append(body["messages"])
    for s in w.sessions:
        (history,) = [v for k, v in by_session.items() if k == s.turns[0].user]
        assert [len(m) for m in history] == [1, 3, 5]
        # Each later turn carries the answer the server produced (" 100 101").
        assert history[2][1] == {"role": "assistant", "content": " 100 101"}
        assert history[2][3] == {"role": "assistant", "content": " 100 101"}
        assert history[2][4] == {"role": "user", "content": s.turns[2].user}
    # Think time: a later turn starts at least think_time after the previous one ended.
    recs = sorted(res.records, key=lambda r: (r.session_id, r.turn))
    for prev, nxt in zip(recs, recs[1:], strict=False):
        if prev.session_id == nxt.session_id:
            pause = w.sessions[int(nxt.session_id[1:])].turns[nxt.turn].think_time
            assert nxt.start_time - prev.finish_time >= pause - 0.005


def test_multi_turn_token_ids_with_tokenizer(fake):
    w = multi_turn_workload(1, 2, first_len=4, user_len=2, output_len=3, think_time=0, vocab=VOCAB)
    res = run_load(w, cfg(fake.url), tokenize=lambda t: [int(x) for x in t.split()])
    assert all(r.ok for r in res.records)
    p0, p1 = (b["prompt"] for b in fake.state.received)
    assert p1 == p0 + [100, 101, 102] + w.sessions[0].turns[1].user
    assert res.records[1].cached_tokens == len(p0)


def test_multi_turn_token_ids_returned_by_the_server(fake):
    w = multi_turn_workload(1, 3, first_len=4, user_len=2, output_len=2, think_time=0, vocab=VOCAB)
    res = run_load(w, cfg(fake.url, return_token_ids=True))  # no tokenizer needed
    assert all(r.ok for r in res.records)
    p0, p1, p2 = (b["prompt"] for b in fake.state.received)
    turns = w.sessions[0].turns
    assert p1 == p0 + [100, 101] + turns[1].user
    assert p2 == p1 + [100, 101] + turns[2].user


def test_open_loop_follows_the_arrival_process(fake):
    fake.state.reset(ttft=0.0, itl=0.0)
    w = random_workload(12, 4, 1, vocab=VOCAB)
    res = run_load(w, cfg(fake.url, request_rate=20.0, seed=5))
    expected = arrival_times(12, 20.0, seed=5)
    starts = sorted(r.start_time for r in res.records)
    for got, want in zip(starts, expected, strict=True):
        assert want - 1e-3 <= got < want + 2.0


def test_closed_loop_and_max_concurrency_cap_in_flight(fake):
    fake.state.reset(ttft=0.05, itl=0.01)
    w = random_workload(8, 4, 3, vocab=VOCAB)
    res = run_load(w, cfg(fake.url, concurrency=2))
    assert len(res.records) == 8 and all(r.ok for r in res.records)
    assert fake.state.max_in_flight == 2
    fake.state.reset(ttft=0.05, itl=0.01)
    res = run_load(w, cfg(fake.url, max_concurrency=3))
    assert all(r.ok for r in res.records)
    assert fake.state.max_in_flight == 3


def test_duration_bounds_the_run(fake):
    fake.state.reset(ttft=0.05, itl=0.2)
    w = random_workload(6, 4, 50, vocab=VOCAB)  # 10 s per request
    t = time.monotonic()
    res = run_load(w, cfg(fake.url, concurrency=2, duration=0.6))
    assert time.monotonic() - t < 6.0
    assert len(res.records) == 2 and all(r.error == CANCELLED for r in res.records)
    assert all(r.ttft is not None for r in res.records)  # measured up to the cancellation
    assert res.unsent_sessions == 4
    assert 0.6 - 1e-6 <= res.duration < 2.0


def test_warmup_is_not_measured(fake):
    w = random_workload(3, 4, 2, vocab=VOCAB, seed=0)
    warm = random_workload(2, 4, 2, vocab=VOCAB, seed=9)
    res = run_load(w, cfg(fake.url), warmup=warm)
    assert len(res.records) == 3 and len(fake.state.received) == 5


def test_trace_replay_round_trip(fake, tmp_path):
    fake.state.reset(ttft=0.0, itl=0.0)
    w = multi_turn_workload(2, 2, first_len=3, user_len=2, output_len=2, think_time=0, kind="text")
    res = run_load(w, cfg(fake.url, record_trace=True, api="completions"))
    assert len(res.sent_trace) == 4
    path = tmp_path / "sent.jsonl"
    write_trace(path, res.sent_trace)
    replay = load_trace(path)
    sent = [b["prompt"] for b in fake.state.received]
    fake.state.reset(ttft=0.0, itl=0.0)
    res2 = run_load(replay, cfg(fake.url))
    assert all(r.ok for r in res2.records)
    assert sorted(b["prompt"] for b in fake.state.received) == sorted(sent)
    # Replayed at the recorded times (relative to the first).
    arrivals = sorted(s.arrival_time for s in replay.sessions)
    starts = sorted(r.start_time for r in res2.records)
    assert arrivals[0] == 0.0
    assert all(got >= want - 1e-3 for got, want in zip(starts, arrivals, strict=True))


def test_discover_model(fake):
    assert discover_model(fake.url + "/v1") == "fake-model"
