"""Expert load on /metrics for mixture-of-experts models.

``kvserve:moe_expert_tokens_total{layer, expert}``: tokens this server (this data-parallel
rank) routed to each expert of each MoE layer, a counter (its rate is tokens per expert per
second; divided by the step rate, tokens per expert per step). ``kvserve:moe_expert_load_
imbalance{layer}``: the busiest expert's count over the mean since start (1.0 is perfectly
balanced; what an expert placement / rebalancing would act on). Read at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class ExpertLoadCollector(Collector):
    def __init__(self, model: Any, model_name: str) -> None:
        self.model = model
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        load = self.model.expert_load()
        tokens = CounterMetricFamily(
            "kvserve:moe_expert_tokens",
            "Tokens routed to each expert of each MoE layer.",
            labels=["model_name", "layer", "expert"],
        )
        imbalance = GaugeMetricFamily(
            "kvserve:moe_expert_load_imbalance",
            "Tokens of the busiest expert over the mean, per MoE layer, since start.",
            labels=["model_name", "layer"],
        )
        for layer, counts in load.items():
            for expert, n in enumerate(counts):
                tokens.add_metric([self.model_name, str(layer), str(expert)], n)
            mean = sum(counts) / len(counts)
            imbalance.add_metric([self.model_name, str(layer)], max(counts) / mean if mean else 1.0)
        yield tokens
        yield imbalance


def register_expert_metrics(registry: CollectorRegistry, model: Any, model_name: str) -> bool:
    """Register the collector when ``model`` is a MoE model; returns whether it did."""
    if not hasattr(model, "expert_load"):
        return False
    registry.register(ExpertLoadCollector(model, model_name))
    return True
