"""Workload generators: deterministic, and shaped as specified."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from kvserve.bench.arrivals import arrival_times
from kvserve.bench.workloads import (
    Conversation,
    Vocab,
    kv_capacity_tokens,
    multi_turn_workload,
    prefix_groups_workload,
    random_workload,
    size_prefix_groups,
    system_prompt_workload,
)

VOCAB = Vocab(1000, frozenset({0, 1, 2}))


def _dump(w) -> str:
    return json.dumps([(s.session_id, s.prefix, [t.__dict__ for t in s.turns]) for s in w.sessions])


def test_random_is_deterministic_and_exact_lengths():
    a = random_workload(50, 64, 16, vocab=VOCAB, seed=3)
    b = random_workload(50, 64, 16, vocab=VOCAB, seed=3)
    c = random_workload(50, 64, 16, vocab=VOCAB, seed=4)
    assert _dump(a) == _dump(b)
    assert _dump(a) != _dump(c)
    assert a.num_requests == 50 and len(a.sessions) == 50
    ids = set()
    for s in a.sessions:
        (turn,) = s.turns
        assert len(turn.user) == 64 and turn.output_len == 16 and not s.prefix
        ids.update(turn.user)
    assert not ids & {0, 1, 2}
    assert min(ids) >= 3 and max(ids) < 1000
    # Random prompts share (almost) nothing: distinct first blocks.
    assert len({tuple(s.turns[0].user[:16]) for s in a.sessions}) == 50


def test_random_range_ratio_bounds():
    w = random_workload(200, 100, 20, vocab=VOCAB, range_ratio=0.5, seed=0)
    lens = [len(s.turns[0].user) for s in w.sessions]
    outs = [s.turns[0].output_len for s in w.sessions]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 20
    assert min(outs) >= 10 and max(outs) <= 30


def test_text_workload_is_text():
    w = random_workload(5, 40, 8, kind="text", seed=1)
    for s in w.sessions:
        assert isinstance(s.turns[0].user, str)
        assert len(s.turns[0].user.split()) == 40
    assert w.kind == "text"
    with pytest.raises(ValueError, match="vocabulary"):
        random_workload(5, 40, 8, kind="tokens")


def test_multi_turn_history_grows_with_answers():
    w = multi_turn_workload(
        3,
        4,
        first_len=32,
        user_len=8,
        output_len=5,
        think_time=0.5,
        system_prompt_len=16,
        vocab=VOCAB,
        seed=0,
    )
    assert w.num_requests == 12
    s = w.sessions[0]
    assert len(s.prefix) == 16 and all(x.prefix == s.prefix for x in w.sessions)
    assert [len(t.user) for t in s.turns] == [32, 8, 8, 8]
    assert s.turns[0].think_time == 0 and all(t.think_time > 0 for t in s.turns[1:])
    conv = Conversation(s)
    prev = None
    for k, turn in enumerate(s.turns):
        req = conv.next_request()
        assert req.turn == k and req.output_len == 5
        if prev is None:
            assert req.prompt == s.prefix + turn.user
        else:
            prompt, answer = prev
            assert req.prompt == prompt + answer + turn.user
        answer = [500 + k, 501 + k, 502 + k]
        conv.record_answer("ignored", answer)
        prev = (req.prompt, answer)
    assert conv.done
    with pytest.raises(IndexError):
        conv.next_request()


def test_multi_turn_think_times_have_the_mean():
    w = multi_turn_workload(200, 6, think_time=2.0, vocab=VOCAB, seed=1)
    pauses = [t.think_time for s in w.sessions for t in s.turns[1:]]
    assert statistics.mean(pauses) == pytest.approx(2.0, rel=0.1)


def test_conversation_chat_and_text_modes():
    w = multi_turn_workload(1, 3, first_len=4, user_len=3, system_prompt_len=5, kind="text")
    s = w.sessions[0]
    chat = Conversation(s, "chat")
    r0 = chat.next_request()
    assert r0.messages == [
        {"role": "system", "content": s.prefix},
        {"role": "user", "content": s.turns[0].user},
    ]
    chat.record_answer("first answer")
    r1 = chat.next_request()
    assert r1.messages[2:] == [
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": s.turns[1].user},
    ]
    with pytest.raises(RuntimeError):
        chat.next_request()  # the answer of turn 1 is missing
    text = Conversation(s, "completions")
    p0 = text.next_request().prompt
    assert p0 == s.prefix + "\n" + s.turns[0].user
    text.record_answer(" the answer")
    assert text.next_request().prompt == p0 + " the answer" + "\n" + s.turns[1].user


def test_token_history_without_ids_needs_a_tokenizer():
    w = multi_turn_workload(1, 2, vocab=VOCAB)
    conv = Conversation(w.sessions[0])
    conv.next_request()
    with pytest.raises(ValueError, match="tokenizer"):
        conv.record_answer("12 13")
    conv = Conversation(w.sessions[0], tokenize=lambda t: [int(x) for x in t.split()])
    p0 = conv.next_request().prompt
    conv.record_answer("12 13")
    assert conv.next_request().prompt == p0 + [12, 13] + w.sessions[0].turns[1].user


def test_chat_needs_text():
    w = random_workload(1, 4, 2, vocab=VOCAB)
    with pytest.raises(ValueError, match="text"):
        Conversation(w.sessions[0], "chat").next_request()


def test_system_prompts_shared_by_users():
    w = system_prompt_workload(
        4, 100, system_prompt_len=64, question_len=8, output_len=4, vocab=VOCAB, seed=2
    )
    assert len(w.sessions) == 100
    by_group: dict[int, set] = {}
    for s in w.sessions:
        by_group.setdefault(s.group, set()).add(tuple(s.prefix))
        assert len(s.prefix) == 64 and len(s.turns[0].user) == 8
    assert sorted(by_group) == [0, 1, 2, 3]
    assert all(len(v) == 1 for v in by_group.values())  # one prompt per group
    assert len({next(iter(v)) for v in by_group.values()}) == 4  # distinct across groups
    # Questions are private.
    assert len({tuple(s.turns[0].user) for s in w.sessions}) == 100


def test_prefix_groups_shape_and_interleaving():
    w = prefix_groups_workload(
        10, 5, prefix_len=48, question_len=8, output_len=4, vocab=VOCAB, seed=0
    )
    assert len(w.sessions) == 50
    groups: dict[int, list] = {}
    for s in w.sessions:
        groups.setdefault(s.group, []).append(s)
    assert sorted(groups) == list(range(10))
    for members in groups.values():
        assert len(members) == 5
        assert all(m.prefix == members[0].prefix for m in members)
        assert len(members[0].prefix) == 48
    assert len({tuple(m[0].prefix) for m in groups.values()}) == 10
    order = [s.group for s in w.sessions]
    assert order != sorted(order)  # interleaved arrivals
    again = prefix_groups_workload(
        10, 5, prefix_len=48, question_len=8, output_len=4, vocab=VOCAB, seed=0
    )
    assert _dump(w) == _dump(again)


def test_size_prefix_groups_fills_the_fraction():
    cap = kv_capacity_tokens(16, 5000, 16)  # 1.28M tokens
    groups, plen = size_prefix_groups(cap, 0.7, prefix_len=6000)
    assert plen == 6000
    assert groups * 6000 == pytest.approx(0.7 * cap, rel=0.01)
    groups, plen = size_prefix_groups(cap, 0.7, num_groups=150)
    assert groups == 150 and plen % 16 == 0
    assert 0.7 * cap - 150 * 16 < groups * plen <= 0.7 * cap
    with pytest.raises(ValueError):
        size_prefix_groups(cap, 0.7)
    with pytest.raises(ValueError):
        size_prefix_groups(100, 0.7, num_groups=1000)


def test_vocab_from_model_dir(tmp_path):
    tok = {
        "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(300)}},
        "added_tokens": [
            {"id": 300, "content": "<s>", "special": True},
            {"id": 301, "content": "</s>", "special": True},
        ],
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 320, "eos_token_id": 7}))
    v = Vocab.from_model_dir(tmp_path)
    assert v.vocab_size == 302
    assert v.special_ids == {300, 301, 7}
    with pytest.raises(FileNotFoundError):
        Vocab.from_model_dir(tmp_path / "missing")


def test_arrival_times():
    t = arrival_times(4000, 10.0, seed=0)
    assert t[0] == 0 and t == sorted(t)
    assert statistics.mean(b - a for a, b in zip(t, t[1:], strict=False)) == pytest.approx(
        0.1, rel=0.05
    )
    assert t == arrival_times(4000, 10.0, seed=0)
    bursty = arrival_times(4000, 10.0, burstiness=0.2, seed=0)
    gaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.15)
    assert statistics.pstdev(gaps) > 0.15  # gamma(k=0.2): cv = sqrt(5)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
