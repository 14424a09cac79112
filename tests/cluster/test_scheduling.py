"""Scorers, pickers, filters and the scheduler's composition and reasons."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from kvserve.cluster.config import EndpointSpec, PickerSpec, SchedulerConfig, ScorerSpec
from kvserve.cluster.endpoints import Endpoint
from kvserve.cluster.filters import HealthyFilter, ModelFilter, NoEndpointError
from kvserve.cluster.history import RoutingHistory, SessionTable
from kvserve.cluster.kv_index import KVIndex
from kvserve.cluster.pickers import (
    MaxScorePicker,
    RandomPicker,
    RoundRobinPicker,
    WeightedRandomPicker,
    make_picker,
)
from kvserve.cluster.routing_request import RoutingRequest
from kvserve.cluster.scheduler import Scheduler
from kvserve.cluster.scorers import (
    ApproxPrefixScorer,
    KVCacheUtilScorer,
    LoadScorer,
    PrecisePrefixScorer,
    QueueDepthScorer,
    SessionAffinityScorer,
    make_scorer,
)
from kvserve.engine.hashing import hash_block_tokens
from kvserve.kv.events import BlockStored

BS = 4


def ep(name: str, *, model: str = "m", healthy: bool = True, events: bool = True, **state):
    spec = EndpointSpec(
        url=f"http://{name}:1",
        name=name,
        model=model,
        kv_events=f"tcp://{name}:2" if events else None,
    )
    e = Endpoint(spec, models=(model,), healthy=healthy)
    for k, v in state.items():
        setattr(e, k, v)
    return e


def store_prefix(index: KVIndex, endpoint: str, tokens: list[int], medium: str = "GPU") -> None:
    n = len(tokens) // BS
    index.apply_events(
        endpoint,
        [
            BlockStored(
                block_hashes=list(range(n)),
                parent_block_hash=None,
                token_ids=tokens[: n * BS],
                block_size=BS,
                medium=medium,
            )
        ],
    )


class Ctx:
    def __init__(self) -> None:
        self.index = KVIndex()
        self.history = RoutingHistory(ttl_s=60)
        self.sessions = SessionTable()
        self.history_block_size = BS


PROMPT = list(range(1, 8 * BS + 2))  # 8 cacheable blocks


def test_precise_prefix_scores_the_run_fraction_with_tier_weights() -> None:
    idx = KVIndex()
    a, b, c, d = ep("a"), ep("b"), ep("c"), ep("d")
    store_prefix(idx, "a", PROMPT[: 8 * BS])  # everything cacheable
    store_prefix(idx, "b", PROMPT[: 4 * BS])  # half
    store_prefix(idx, "c", PROMPT[: 8 * BS], medium="CPU")
    scores = PrecisePrefixScorer(idx).score(RoutingRequest(token_ids=PROMPT), [a, b, c, d])
    assert scores == pytest.approx([1.0, 0.5, 0.8, 0.0])
    # No tokens (untokenizable prompt): no signal.
    assert PrecisePrefixScorer(idx).score(RoutingRequest(text=b"x"), [a]) == [0.0]
    # A prompt shorter than a block has nothing cacheable.
    assert PrecisePrefixScorer(idx).score(RoutingRequest(token_ids=[1, 2]), [a]) == [0.0]


def test_precise_prefix_counts_blocks_just_sent_until_their_events_arrive() -> None:
    idx = KVIndex()
    a, b, c = ep("a"), ep("b"), ep("c", events=False)
    store_prefix(idx, "a", PROMPT[: 2 * BS])
    scorer = PrecisePrefixScorer(idx, default_block_size=BS, speculative_ttl_s=0.2)
    assert scorer.score(RoutingRequest(token_ids=PROMPT), [a, b, c]) == [0.25, 0.0, 0.0]
    scorer.observe(RoutingRequest(token_ids=PROMPT), b)  # no events from b yet
    scorer.observe(RoutingRequest(token_ids=PROMPT), c)  # no events at all: approx_prefix's
    assert scorer.score(RoutingRequest(token_ids=PROMPT), [a, b, c]) == [0.25, 1.0, 0.0]
    half = PROMPT[: 4 * BS] + [999] * (4 * BS + 1)  # shares 4 of 8 blocks
    assert scorer.score(RoutingRequest(token_ids=half), [a, b, c]) == [0.25, 0.5, 0.0]
    time.sleep(0.45)  # > 2 x ttl: only what events said is left
    assert scorer.score(RoutingRequest(token_ids=PROMPT), [a, b, c]) == [0.25, 0.0, 0.0]
    assert PrecisePrefixScorer(idx, speculative_ttl_s=0).speculative is None


def test_approx_prefix_uses_history_only_for_endpoints_without_events() -> None:
    hist = RoutingHistory(ttl_s=60)
    a, b = ep("a", events=False), ep("b", events=False)
    scorer = ApproxPrefixScorer(hist, BS)
    req = RoutingRequest(token_ids=PROMPT)
    assert scorer.score(req, [a, b]) == [0.0, 0.0]
    scorer.observe(req, a)
    assert scorer.score(RoutingRequest(token_ids=PROMPT), [a, b]) == [1.0, 0.0]
    half = PROMPT[: 4 * BS] + [999] * (4 * BS + 1)
    assert scorer.score(RoutingRequest(token_ids=half), [a, b]) == [0.5, 0.0]
    # Text prompts work through raw-text chunks.
    t1 = RoutingRequest(text=b"system prompt " * 40)
    scorer.observe(t1, b)
    assert scorer.score(RoutingRequest(text=b"system prompt " * 40 + b"more"), [a, b])[1] > 0.9
    # Endpoints with events are left to the precise scorer.
    c = ep("c", events=True)
    scorer.observe(req, c)
    assert scorer.score(req, [c]) == [0.0]
    assert ApproxPrefixScorer(hist, BS, only_without_events=False).score(req, [a])[0] == 1.0


def test_history_ttl_and_bound() -> None:
    hist = RoutingHistory(ttl_s=10, max_blocks_per_endpoint=8)
    hist.record("a", [1, 2, 3], now=0.0)
    assert hist.match("a", [1, 2, 3, 9], now=1.0) == 3 and hist.match("b", [1], now=1.0) == 0
    assert hist.match("a", [1, 2, 7, 8], now=1.0) == 2  # diverges after block 1
    assert hist.match("a", [1, 2, 3], now=15.0) == 3  # kept for at least ttl_s
    hist.record("a", [1, 2], now=15.0)  # routed again: kept for another ttl_s
    assert hist.match("a", [1, 2, 3], now=21.0) == 2  # 3 was last routed > 2 * ttl_s ago
    assert hist.match("a", [1, 2, 3], now=41.0) == 0  # expired
    assert hist.size() == 0
    # The bound: at most max_blocks_per_endpoint keys, the oldest generation dropped first.
    for i in range(10):
        hist.record("a", [100 * i + j for j in range(3)], now=50.0)
        assert hist.size() <= 8
    assert hist.match("a", [900, 901, 902], now=50.0) == 3
    assert hist.match("a", [0, 1, 2], now=50.0) == 0


def test_load_queue_and_kv_util_scorers_are_normalized() -> None:
    a = ep("a", num_requests_waiting=0, num_requests_running=2, kv_cache_usage_perc=0.25)
    b = ep("b", num_requests_waiting=4, num_requests_running=40, kv_cache_usage_perc=1.5)
    c = ep("c", num_requests_waiting=2, in_flight=8)
    req = RoutingRequest()
    assert QueueDepthScorer().score(req, [a, b, c]) == [1.0, 0.0, 0.5]
    assert QueueDepthScorer().score(req, [a, a]) == [1.0, 1.0]
    assert KVCacheUtilScorer().score(req, [a, b, c]) == [0.75, 0.0, 1.0]
    # active = max(running + waiting, in flight); capped at capacity.
    assert LoadScorer(capacity=16).score(req, [a, b, c]) == [1 - 2 / 16, 0.0, 1 - 8 / 16]
    with pytest.raises(ValueError):
        LoadScorer(capacity=0)


def test_session_affinity() -> None:
    sessions = SessionTable(ttl_s=100)
    a, b = ep("a"), ep("b")
    s = SessionAffinityScorer(sessions)
    req = RoutingRequest(session_id="s1")
    assert s.score(req, [a, b]) == [0.0, 0.0]
    s.observe(req, b)
    assert s.score(req, [a, b]) == [0.0, 1.0]
    assert s.score(RoutingRequest(session_id="other"), [a, b]) == [0.0, 0.0]
    sessions.forget_endpoint("b")
    assert s.score(req, [a, b]) == [0.0, 0.0]


def test_pickers() -> None:
    scores = [0.2, 0.9, 0.9, 0.1]
    mp = MaxScorePicker(seed=1)
    firsts = Counter(mp.rank(scores)[0] for _ in range(200))
    assert set(firsts) == {1, 2}  # ties broken at random, never a lower score
    assert MaxScorePicker(seed=1).rank(scores)[2:] == [0, 3]  # failover order by score
    wr = WeightedRandomPicker(seed=3)
    picks = Counter(wr.rank([0.0, 1.0, 3.0])[0] for _ in range(2000))
    assert picks[0] == 0 and 0.6 < picks[2] / 2000 < 0.9
    assert sorted(wr.rank([0.0, 0.0])) == [0, 1]
    rr = RoundRobinPicker()
    assert [rr.rank([0, 0, 0])[0] for _ in range(4)] == [0, 1, 2, 0]
    assert sorted(RandomPicker(seed=0).rank([1, 2, 3])) == [0, 1, 2]
    with pytest.raises(ValueError):
        make_picker("best")
    with pytest.raises(ValueError):
        make_picker("max_score", {"nope": 1})


def test_filters() -> None:
    a, b = ep("a", model="m1"), ep("b", model="m2", healthy=False)
    assert ModelFilter().apply(RoutingRequest(model="m2"), [a, b]) == [b]
    assert ModelFilter().apply(RoutingRequest(model=None), [a, b]) == [a, b]
    with pytest.raises(NoEndpointError) as e:
        ModelFilter().apply(RoutingRequest(model="zz"), [a, b])
    assert e.value.status == 404
    with pytest.raises(NoEndpointError) as e:
        HealthyFilter().apply(RoutingRequest(), [b])
    assert e.value.status == 503
    unknown = Endpoint(EndpointSpec(url="http://u:1"))  # never answered: models unknown
    with pytest.raises(NoEndpointError) as e:
        ModelFilter().apply(RoutingRequest(model="zz"), [a, unknown])
    assert e.value.status == 503


def test_scheduler_prefers_prefix_until_load_outweighs_it() -> None:
    ctx = Ctx()
    cfg = SchedulerConfig(
        scorers=[ScorerSpec("precise_prefix", 3.0), ScorerSpec("load", 2.0, {"capacity": 10})],
        picker=PickerSpec("max_score", {"seed": 0}),
    )
    sched = Scheduler.from_config(cfg, ctx)
    a, b = ep("a"), ep("b")
    store_prefix(ctx.index, "b", PROMPT[: 8 * BS])
    d = sched.schedule(RoutingRequest(model="m", token_ids=PROMPT), [a, b])
    assert [e.name for e in d.ranked] == ["b", "a"] and d.reason == "precise_prefix"
    assert d.scores == {"a": 2.0, "b": 5.0}
    b.in_flight = 10  # b saturated: 3 + 0 vs 0 + 2 -> still b (a full hit beats idle)
    assert sched.schedule(RoutingRequest(model="m", token_ids=PROMPT), [a, b]).ranked[0] is b
    half = PROMPT[: 2 * BS] + [7] * (6 * BS + 1)  # 1/4 hit: 0.75 < 2 -> a, for load
    d = sched.schedule(RoutingRequest(model="m", token_ids=half), [a, b])
    assert d.ranked[0] is a and d.reason == "load"


def test_scheduler_reasons_single_tie_and_unhealthy() -> None:
    ctx = Ctx()
    sched = Scheduler.from_config(SchedulerConfig(), ctx)
    a, b, c = ep("a"), ep("b"), ep("c", healthy=False)
    assert sched.schedule(RoutingRequest(model="m"), [a, c]).reason == "single_candidate"
    d = sched.schedule(RoutingRequest(model="m", token_ids=PROMPT), [a, b, c])
    assert d.reason == "tie" and {e.name for e in d.ranked} == {"a", "b"}
    with pytest.raises(NoEndpointError):
        sched.schedule(RoutingRequest(model="m"), [c])


def test_scheduler_observe_feeds_history_and_sessions() -> None:
    ctx = Ctx()
    cfg = SchedulerConfig(
        scorers=[ScorerSpec("approx_prefix", 3.0), ScorerSpec("session_affinity", 1.0)]
    )
    sched = Scheduler.from_config(cfg, ctx)
    a, b = ep("a", events=False), ep("b", events=False)
    req = RoutingRequest(model="m", token_ids=PROMPT, session_id="s")
    sched.observe(req, b)
    d = sched.schedule(RoutingRequest(model="m", token_ids=PROMPT, session_id="s"), [a, b])
    assert d.ranked[0] is b and d.scores["b"] == 4.0 and d.reason == "approx_prefix"
    with pytest.raises(ValueError):
        make_scorer("psychic", ctx)
    with pytest.raises(ValueError):
        make_scorer("load", ctx, {"capacity": 1, "bogus": 2})


def test_routing_request_keys_memoized_and_salted() -> None:
    req = RoutingRequest(token_ids=PROMPT, cache_salt="t1")
    keys = req.block_keys(BS)
    assert keys is req.block_keys(BS) and len(keys) == 8
    plain = hash_block_tokens(PROMPT[:-1], BS)
    assert keys[0] != int.from_bytes(plain[0][-8:], "big")
    assert keys[1:] != [int.from_bytes(h[-8:], "big") for h in plain[1:]]  # chain differs
