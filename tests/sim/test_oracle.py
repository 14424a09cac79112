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
