"""Wire models of the OpenAI-compatible API (pydantic v2): requests, responses, chunks, errors.

Owns the shapes only: field names and types follow OpenAI's API (plus vLLM's extensions
``top_k``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``cache_salt``); turning them
into engine requests is :mod:`kvserve.server.serving`'s job. Requests validate strictly
(``"16"`` is not an integer); unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    # Usage on every chunk too (vLLM extension; needs include_usage, as in vLLM).
    continuous_usage_stats: bool = False


class ResponseFormat(_Request):
    """Only ``text`` is served: ``json_object`` / ``json_schema`` need guided decoding, which
    kvserve does not have, and are refused with 400 rather than silently ignored."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # defaults to the served model
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = None  # accepted only as 0 (not implemented)
    frequency_penalty: float | None = None  # accepted only as 0 (not implemented)
    logit_bias: dict[str, float] | None = None  # accepted only empty (not implemented)
    user: str | None = None
    # Extensions (vLLM's names).
    top_k: int | None = None  # -1 or 0: disabled
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None  # isolates this tenant's prefix cache
    response_format: ResponseFormat | None = None
    # Prefill/decode disaggregation, vLLM's contract: {"do_remote_decode": true} on the prefill
    # leg; the parameters its response returned on the decode leg.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``prompt``: text, token ids, or a batch of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # accepted only as false (not implemented)
    best_of: int | None = None  # accepted only when equal to n
    suffix: str | None = None  # accepted only as null (not implemented)


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """``developer`` is rendered as ``system`` (as OpenAI treats it for models without that
    role); ``tool`` reaches the template, and a template without it gets a 400."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None  # accepted only empty (not implemented)
    add_generation_prompt: bool = True  # vLLM extension
    # vLLM extension: extra variables for the chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------------
# Responses


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CacheBreakdown(BaseModel):
    """Where the prompt tokens' KV came from (kvserve extension of ``usage``)."""

    cached_tokens_primary: int = 0  # primary pool prefix-cache hits
    cached_tokens_offload: int = 0  # loaded from a KV connector (offload tier, peer)
    computed_tokens: int = 0  # prefilled by this request


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    kvserve: CacheBreakdown | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # P/D: the decode leg's parameters


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # P/D: the decode leg's parameters


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
