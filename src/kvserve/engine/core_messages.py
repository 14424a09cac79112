"""The wire format between the API server process and the engine-core process.

Owns the messages (msgspec structs, msgpack on ZMQ sockets) and nothing else. The client
sends :class:`AddRequest`, :class:`AbortRequests` and :class:`Shutdown`; the core answers
with :class:`Ready` (or :class:`Failed`) once, then :class:`Accepted` per add (in command
order), :class:`StepOutputs` after each step with outputs (an abort's final outputs too) and
:class:`StatsUpdate` while busy and whenever it goes idle. Outputs are deltas (the tokens and
text a step added), as vLLM v1's ``EngineCoreOutput``: the client keeps each request's
cumulative state, so a step's message does not grow with the requests' lengths.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvserve.engine.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=0, array_like=True):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class AbortRequests(msgspec.Struct, tag=1, array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=2, array_like=True):
    pass


ClientMessage = AddRequest | AbortRequests | Shutdown


class CoreOutput(msgspec.Struct, array_like=True):
    """One request's progress in one step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    # RequestMetrics' fields, in declaration order (a tuple: no field names on the wire).
    metrics: tuple
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Top logprobs of each new token; the running sum of the sampled tokens' logprobs.
    new_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    # The prompt's token ids, on a text prompt's first output only (the core tokenized it).
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class Ready(msgspec.Struct, tag=10, array_like=True):
    model_name: str
    max_model_len: int
    num_kv_blocks: int
    has_connector: bool
    has_expert_load: bool
    pid: int


class Failed(msgspec.Struct, tag=11, array_like=True):
    error: str


class Accepted(msgspec.Struct, tag=12, array_like=True):
    request_id: str
    # The engine's ValueError message for bad input; None when the request was added.
    error: str | None = None


class StepOutputs(msgspec.Struct, tag=13, array_like=True):
    outputs: list[CoreOutput]
    num_steps: int


class StatsUpdate(msgspec.Struct, tag=15, array_like=True):
    # ``EngineStats`` as msgspec's builtins (decoded by the client into the dataclass).
    stats: dict[str, Any]
    # MoE models: tokens routed per expert, by layer (``model.expert_load()``).
    expert_load: dict[int, list[int]] | None = None


CoreMessage = Ready | Failed | Accepted | StepOutputs | StatsUpdate

client_encoder = msgspec.msgpack.Encoder()
core_decoder = msgspec.msgpack.Decoder(ClientMessage)
core_encoder = msgspec.msgpack.Encoder()
client_decoder = msgspec.msgpack.Decoder(CoreMessage)
