"""Request and sequence state owned by the scheduler.

A request moves WAITING -> (WAITING_FOR_REMOTE_KVS ->) RUNNING -> FINISHED_*, and back to
PREEMPTED (then waiting again) when the primary pool runs out. ``all_token_ids`` grows with
each sampled token; ``num_computed_tokens`` counts tokens whose KV is in the block table.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.hashing import BlockHash, BlockHasher
from kvserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # skipped by the scheduler until its KV load finishes
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # rejected at admission (e.g. longer than the KV pool)

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_IGNORED: "length",
        }.get(self)


@dataclass
class RequestTimes:
    """Timestamps (``time.monotonic()``), for per-request metrics."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


class Request:
    """One sequence being served."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        block_size: int,
        eos_token_id: int | None = None,
        prefix_hash_seed: str = "kvserve",
        cache_salt: str | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        prompt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        # P/D (vLLM's contract): what the caller asked of the KV connector, and what the
        # connector returns once the request finished (where its KV can be pulled from).
        self.kv_transfer_params = kv_transfer_params
        self.finished_kv_transfer_params: dict[str, Any] | None = None
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Per generated token: (sampled logprob, {token_id: logprob} top-k) when requested.
        self.output_logprobs: list[tuple[float, dict[int, float]]] = []
        self.num_computed_tokens = 0
        # Prompt tokens served from the primary prefix cache / from a connector (tier, peer).
        self.num_cached_tokens = -1  # -1 until first scheduled
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0
        self.times = RequestTimes()
        self._hasher = BlockHasher(block_size, prefix_hash_seed, cache_salt, lora_name)
        self._hasher.update(self.all_token_ids)

    # -- tokens ---------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Hashes of every full block of ``all_token_ids`` (kept up to date by append)."""
        return self._hasher.hashes

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._hasher.update(self.all_token_ids)

    # -- status ---------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
