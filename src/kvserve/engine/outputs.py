"""Data passed between engine layers: scheduler -> runner -> engine -> users.

- :class:`SchedulerOutput`: what to compute this step (scheduler -> model runner).
- :class:`ModelRunnerOutput`: what was sampled (model runner -> scheduler).
- :class:`RequestOutput` / :class:`CompletionOutput`: what users see (vLLM's shape).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.request import Request


@dataclass
class SchedulerOutput:
    """One step's work. ``scheduled`` requests are in batch order: decodes first, then prefills.

    For each scheduled request the runner computes tokens
    ``all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens[id]]``
    writing their KV into ``block_ids`` (the request's full block table; one per KV cache group
    in ``group_block_ids`` when the model has several), and samples a token
    only if that reaches the end of ``all_token_ids``.
    """

    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Models with several KV cache groups: every group's block table (``block_ids`` is group
    # 0's); empty for single-group models.
    group_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    # Opaque per-step instructions for the worker side of the KV connector (None without one).
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step. ``sampled_token_ids[id]`` is empty for a partial prefill."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request, per sampled token: (logprob of sampled token, {token_id: logprob} top-k).
    logprobs: dict[str, list[tuple[float, dict[int, float]]]] = field(default_factory=dict)
    # Transfers that completed on the worker side (request ids), for the KV connector.
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    # Requests whose KV load failed: they recompute (invalid block ids to drop from the cache).
    invalid_block_ids: set[int] = field(default_factory=set)


@dataclass
class RequestMetrics:
    """Per-request metrics (seconds; ``time.monotonic()`` stamps)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # served from the primary prefix cache
    num_external_cached_tokens: int = 0  # served from a KV connector (offload tier, peer)
    num_computed_prompt_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Cumulative state of one request after a step (``new_token_ids``: this step's delta)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # Set on the finished output when the KV connector returns parameters (P/D: where the
    # decode engine pulls this request's KV from), as vLLM's ``kv_transfer_params``.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens + self.metrics.num_external_cached_tokens
