"""The oracle scorer reads engines' exact cache and queues and predicts TTFT with the model."""

from __future__ import annotations

from kvserve.cluster.config import EndpointSpec
from kvserve.cluster.endpoints import Endpoint
from kvserve.cluster.routing_request import RoutingRequest
from kvserve.config import ServerConfig
from kvserve.engine.sampling_params import SamplingParams
from kvserve.sim.instance import SimCluster, SimEngineConfig
from kvserve.sim.oracle import OracleScorer


def test_prefers_the_cached_instance_and_then_the_idle_one(tiny_model_dir):
    cfg = SimEngineConfig(
        model=str(tiny_model_dir),
        sim_latency="h100-llama8b",
        sim_time_scale=0.0,
        num_kv_blocks=512,
        max_model_len=4096,
    )
    cluster = SimCluster.build(3, cfg, ServerConfig(port=0))
    try:
        warm, busy, idle = cluster.instances
        prefix = list(range(100, 1124))  # 64 blocks
        warm.engine.add_request("w", prefix + [1, 2], SamplingParams(max_tokens=1))
        while warm.engine.has_unfinished_requests():
            warm.engine.step()
        for i in range(3):  # queued, not yet scheduled: prefill work ahead
            busy.engine.add_request(
                f"q{i}", list(range(1300 + i, 2300 + i)), SamplingParams(max_tokens=1)
            )
        scorer = OracleScorer(cluster)
        endpoints = [Endpoint(EndpointSpec(url=i.url, name=i.name)) for i in cluster.instances]
        cached = RoutingRequest(token_ids=prefix + [7, 8, 9])
        assert scorer.predicted_ttft(warm, cached) < scorer.predicted_ttft(idle, cached)
        assert scorer.predicted_ttft(idle, cached) < scorer.predicted_ttft(busy, cached)
        scores = scorer.score(cached, endpoints)
        assert scores[0] == 1.0 and scores[1] == 0.0
        fresh = RoutingRequest(token_ids=list(range(2400, 1900, -1)))
        assert max(range(3), key=lambda i: scorer.score(fresh, endpoints)[i]) != 1
    finally:
        cluster.close()


def _cluster(model_dir, n: int, num_kv_blocks: int) -> SimCluster:
    return SimCluster.build(
        n,
        SimEngineConfig(
            model=str(model_dir),
            sim_latency="h100-llama8b",
            sim_time_scale=0.0,
            num_kv_blocks=num_kv_blocks,
            max_model_len=4096,
        ),
        ServerConfig(port=0),
    )


def _serve(inst, rid: str, tokens: list[int]) -> None:
    inst.engine.add_request(rid, tokens, SamplingParams(max_tokens=1))
    while inst.engine.has_unfinished_requests():
        inst.engine.step()


def _prefix(group: int, num_blocks: int = 80) -> list[int]:
    """A prompt prefix of ``num_blocks`` full blocks, distinct per group (tiny vocab: 2427)."""
    return [(group * 131 + i * 7) % 2400 + 10 for i in range(16 * num_blocks)]


def test_a_miss_goes_where_it_evicts_no_cached_prefix(tiny_model_dir):
    # 199 usable blocks: two 80-block prefixes fill `full`; `roomy` holds one.
    cluster = _cluster(tiny_model_dir, 2, 200)
    try:
        full, roomy = cluster.instances
        _serve(full, "a", _prefix(1) + [1, 2])
        _serve(full, "b", _prefix(2) + [1, 2])
        _serve(roomy, "c", _prefix(3) + [1, 2])
        scorer = OracleScorer(cluster)
        endpoints = [Endpoint(EndpointSpec(url=i.url, name=i.name)) for i in cluster.instances]
        miss = RoutingRequest(token_ids=_prefix(4) + [3, 4])
        p_full, p_roomy = scorer.predict(full, miss), scorer.predict(roomy, miss)
        # Same TTFT either way (both idle, both miss); only `full` loses cached prefix blocks.
        assert scorer.predicted_ttft(full, miss) == scorer.predicted_ttft(roomy, miss)
        assert p_roomy.evict == 0.0 and p_full.evict > 0.0
        assert scorer.score(miss, endpoints) == [0.0, 1.0]
        # A hit on the full instance evicts nothing it needs and wins.
        hit = RoutingRequest(token_ids=_prefix(2) + [5, 6])
        assert scorer.predict(full, hit).evict == 0.0
        assert scorer.score(hit, endpoints)[0] == 1.0
    finally:
        cluster.close()


def test_simultaneous_misses_spread_whatever_the_tie_break(tiny_model_dir):
    # Requests routed before any engine receives them: each is counted where the picker
    # sends it (one score of 1.0, never a tie the picker breaks its own way), so four
    # fresh prefixes on two idle instances go two and two, for every picker seed.
    from kvserve.cluster.pickers import MaxScorePicker
    from kvserve.cluster.scheduler import Scheduler

    cluster = _cluster(tiny_model_dir, 2, 400)
    try:
        endpoints = [Endpoint(EndpointSpec(url=i.url, name=i.name)) for i in cluster.instances]
        for seed in range(8):
            scheduler = Scheduler([], [(OracleScorer(cluster), 1.0)], MaxScorePicker(seed=seed))
            picks = []
            for g in range(4):
                req = RoutingRequest(token_ids=_prefix(10 + g) + [1])
                decision = scheduler.schedule(req, endpoints)
                assert sorted(decision.scores.values())[-2:] != [1.0, 1.0]
                picks.append(decision.ranked[0].name)
            assert sorted(picks) == sorted([e.name for e in endpoints] * 2), (seed, picks)
    finally:
        cluster.close()
