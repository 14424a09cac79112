"""OpenAI completions and chat completions on top of an :class:`AsyncEngine`.

Owns request validation (model, prompt, lengths, sampling fields), tokenization through the
:class:`TokenizerPool` (large inputs off the event loop), admission (429 when the engine's
queue is full), the fan-out of one API request into engine requests (one per prompt and
choice, ``n`` with derived seeds), and the assembly of responses and SSE chunks from engine
outputs. Every engine request it starts is aborted if the response ends early (client gone,
error), so no request or block leaks. The limits on what a request may ask for are checked
before it gets here (:mod:`kvserve.server.limits`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from kvserve.engine.async_engine import EngineDeadError, RequestStream
from kvserve.engine.core_client import EngineClient
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.server import tokenizer_worker as jobs
from kvserve.server.admission import AdmissionControl, Ticket
from kvserve.server.errors import UNKNOWN_MODEL_STATUS, APIError, bad_request
from kvserve.server.limits import context_length_exceeded
from kvserve.server.metrics import RequestTracker, ServerMetrics
from kvserve.server.protocol import (
    CacheBreakdown,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    SamplingFields,
    TopLogprob,
    Usage,
)
from kvserve.server.tokenizer_pool import TokenizerPool, TokenizerUnavailable

_INT64 = 1 << 64


@dataclass
class _Choice:
    """Progress of one engine request = one choice of the response."""

    index: int
    prompt_index: int
    num_prompt_tokens: int
    tracker: RequestTracker
    stream: RequestStream | None = None
    last: RequestOutput | None = None
    sent_text: int = 0  # characters of text already streamed
    sent_tokens: int = 0  # tokens already streamed

    @property
    def output(self) -> CompletionOutput | None:
        return self.last.outputs[0] if self.last is not None and self.last.outputs else None


@dataclass
class _Batch:
    """All engine requests of one API request."""

    request_id: str
    model: str
    choices: list[_Choice] = field(default_factory=list)

    def abort(self) -> None:
        for c in self.choices:
            if c.stream is not None:  # accepted by the engine (rejected ones are not counted)
                c.stream.abort()
                c.tracker.finish(None if c.output is None else c.output.finish_reason)

    async def outputs(self) -> AsyncIterator[_Choice]:
        """Each choice whose request progressed, as outputs arrive (merged over choices)."""
        if len(self.choices) == 1:
            c = self.choices[0]
            assert c.stream is not None
            async for out in c.stream:
                c.last = out
                c.tracker.observe(out)
                yield c
            return
        queue: asyncio.Queue[tuple[_Choice, RequestOutput | BaseException | None]]
        queue = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            assert c.stream is not None
            try:
                async for out in c.stream:
                    queue.put_nowait((c, out))
                queue.put_nowait((c, None))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                queue.put_nowait((c, exc))

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            remaining = len(tasks)
            while remaining:
                c, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                c.last = item
                c.tracker.observe(item)
                yield c
        finally:
            for t in tasks:
                t.cancel()

    def kv_transfer_params(self) -> dict[str, Any] | None:
        """P/D: the finished request's parameters for the decode leg (one choice only)."""
        if len(self.choices) != 1 or self.choices[0].last is None:
            return None
        return self.choices[0].last.kv_transfer_params

    def usage(self) -> Usage:
        """Prompt tokens count once per prompt (from its first choice), as OpenAI does."""
        prompt = primary = offload = completion = 0
        seen: set[int] = set()
        for c in self.choices:
            if c.last is None:
                continue
            completion += len(c.last.outputs[0].token_ids) if c.last.outputs else 0
            if c.prompt_index in seen:
                continue
            seen.add(c.prompt_index)
            prompt += len(c.last.prompt_token_ids)
            primary += max(0, c.last.metrics.num_cached_tokens)
            offload += max(0, c.last.metrics.num_external_cached_tokens)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=primary + offload),
            kvserve=CacheBreakdown(
                cached_tokens_primary=primary,
                cached_tokens_offload=offload,
                computed_tokens=max(0, prompt - primary - offload),
            ),
        )


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class OpenAIServing:
    """The two generation endpoints of one engine."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        tokenizers: TokenizerPool,
        admission: AdmissionControl,
        max_prompt_chars: int,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tokenizers = tokenizers
        self.admission = admission
        self.max_prompt_chars = max_prompt_chars
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len

    # -- validation -----------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist.",
                UNKNOWN_MODEL_STATUS,
                param="model",
                code="model_not_found",
            )
        return self.model_name

    def _check_common(self, req: SamplingFields) -> None:
        if req.presence_penalty or req.frequency_penalty:
            raise bad_request("presence_penalty and frequency_penalty are not supported")
        if req.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true")
        ktp = req.kv_transfer_params
        if ktp is not None:
            if req.n != 1:
                raise bad_request("kv_transfer_params needs n=1", "kv_transfer_params")
            if req.stream and ktp.get("do_remote_decode") is True:
                raise bad_request(
                    "kv_transfer_params.do_remote_decode needs stream=false: the decode leg's "
                    "parameters come back in the response body",
                    "kv_transfer_params",
                )
        if req.response_format is not None and req.response_format.type != "text":
            raise bad_request(
                f"response_format {req.response_format.type!r} is not supported: kvserve has no "
                "guided decoding; only 'text' is accepted.",
                "response_format",
            )

    def _check_tokens(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request("The prompt is empty.", param)
        if len(token_ids) >= self.max_model_len:
            raise context_length_exceeded(
                self.max_model_len, f"your prompt has {len(token_ids)} tokens", param
            )

    def _job_result(self, result: tuple[str, Any], param: str) -> list[int]:
        """Token ids from a tokenization job, or the 400 it amounts to."""
        status, value = result
        if status == jobs.OK:
            self._check_tokens(value, param)
            return value
        if status == jobs.TOO_LONG:
            raise context_length_exceeded(
                self.max_model_len, f"your prompt has {value} tokens", param
            )
        if status == jobs.TOO_LONG_PREFIX:
            n, k = value
            raise context_length_exceeded(
                self.max_model_len,
                f"the first {k} characters of your prompt alone are {n} tokens",
                param,
            )
        if status == jobs.TOO_LONG_CHARS:
            raise context_length_exceeded(
                self.max_model_len,
                f"your prompt has {value} characters, more than a prompt of "
                f"{self.max_model_len} tokens can have ({self.max_prompt_chars})",
                param,
            )
        raise bad_request(f"chat template failed: {value}", param)

    async def _tokenize(self, work: Any, param: str) -> list[int]:
        try:
            return self._job_result(await work, param)
        except TokenizerUnavailable as exc:
            raise APIError(f"tokenization failed: {exc}; retry", 503) from exc

    def _max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> int:
        if max_tokens is None:
            return self.max_model_len - num_prompt_tokens
        if max_tokens < 1:
            raise bad_request(f"{param} must be at least 1, got {max_tokens}", param)
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} for the completion). Please reduce the prompt or "
                f"{param}.",
                param,
                "context_length_exceeded",
            )
        return max_tokens

    def _params(
        self, req: SamplingFields, max_tokens: int, logprobs: int | None, seed: int | None
    ) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                seed=seed,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                min_tokens=req.min_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
            )
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc)) from exc

    # -- fan-out --------------------------------------------------------------------------
    async def _start(
        self,
        prefix: str,
        model: str,
        req: SamplingFields,
        prompts: list[list[int]],
        params: list[SamplingParams],
        ticket: Ticket,
    ) -> _Batch:
        """One engine request per (prompt, choice); all accepted or none left running."""
        batch = _Batch(f"{prefix}-{uuid.uuid4().hex}", model)
        for p in range(len(params)):
            for j in range(req.n):
                c = _Choice(
                    index=p * req.n + j,
                    prompt_index=p,
                    num_prompt_tokens=len(prompts[p]),
                    tracker=self.metrics.track(),
                )
                batch.choices.append(c)
        try:
            results = await asyncio.gather(
                *(self._add(batch, c, req, prompts, params, ticket) for c in batch.choices),
                return_exceptions=True,
            )
        except BaseException:  # cancelled: each pending add aborts itself
            batch.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            batch.abort()
            raise errors[0]
        return batch

    async def _add(
        self,
        batch: _Batch,
        c: _Choice,
        req: SamplingFields,
        prompts: list[list[int]],
        params: list[SamplingParams],
        ticket: Ticket,
    ) -> RequestStream:
        base = params[c.prompt_index]
        j = c.index - c.prompt_index * req.n
        p = base
        if j:  # each choice its own params; a derived seed, wrapped into the int64 range
            seed = None if base.seed is None else (base.seed + j + (1 << 63)) % _INT64 - (1 << 63)
            p = dataclasses.replace(base, seed=seed)
        rid = f"{batch.request_id}-{c.prompt_index}-{j}"
        # add_request counts the request in flight before it first yields: no gap in the count.
        ticket.hand_over(1)
        try:
            stream = await self.engine.add_request(
                rid,
                prompts[c.prompt_index],
                p,
                cache_salt=req.cache_salt,
                kv_transfer_params=req.kv_transfer_params,
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        except EngineDeadError as exc:
            raise APIError(str(exc), 503) from exc
        c.stream = stream
        return stream

    # -- completions ----------------------------------------------------------------------
    @staticmethod
    def _prompt_items(req: CompletionRequest) -> list[Any]:
        prompt = req.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("The prompt is empty.", "prompt")
        return items

    async def _completion_prompts(self, items: list[Any]) -> list[list[int]]:
        out = []
        for item in items:
            if not item:  # before tokenizing: "" would still get a BOS token
                raise bad_request("The prompt is empty.", "prompt")
            if isinstance(item, str):
                work = self.tokenizers.encode(item, self.max_prompt_chars, self.max_model_len)
                ids = await self._tokenize(work, "prompt")
            else:
                ids = list(item)
                self._check_tokens(ids, "prompt")
            out.append(ids)
        return out

    async def create_completion(self, req: CompletionRequest) -> Response:
        model = self.check_model(req.model)
        self._check_common(req)
        if req.echo:
            raise bad_request("echo is not supported", "echo")
        if req.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (beam search is not supported)", "best_of")
        items = self._prompt_items(req)
        if req.kv_transfer_params is not None and len(items) != 1:
            raise bad_request("kv_transfer_params needs a single prompt", "kv_transfer_params")
        with self.admission.admit(len(items) * req.n) as ticket:
            prompts = await self._completion_prompts(items)
            params = [
                self._params(
                    req,
                    self._max_tokens(len(ids), req.max_tokens, "max_tokens"),
                    req.logprobs,
                    req.seed,
                )
                for ids in prompts
            ]
            batch = await self._start("cmpl", model, req, prompts, params, ticket)
        if req.stream:
            include_usage, continuous = _usage_options(req)
            return _streaming(
                self._completion_stream(batch, req.logprobs, include_usage, continuous)
            )
        await _drain(batch)
        choices = [
            CompletionChoice(
                index=c.index,
                text=c.output.text,
                logprobs=self._completion_logprobs(c.output, 0, req.logprobs),
                finish_reason=c.output.finish_reason,
                stop_reason=c.output.stop_reason,
            )
            for c in batch.choices
            if c.output is not None
        ]
        resp = CompletionResponse(
            id=batch.request_id,
            model=model,
            choices=choices,
            usage=batch.usage(),
            kv_transfer_params=batch.kv_transfer_params(),
        )
        return _json(resp)

    def _completion_stream(
        self, batch: _Batch, logprobs: int | None, include_usage: bool, continuous: bool
    ) -> AsyncIterator[str]:
        def choice(c: _Choice, out: CompletionOutput, text: str) -> CompletionChoice:
            return CompletionChoice(
                index=c.index,
                text=text,
                logprobs=self._completion_logprobs(
                    out, c.sent_tokens, logprobs, offset=c.sent_text
                ),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )

        return _sse_stream(
            batch,
            CompletionResponse,
            choice,
            include_usage,
            continuous,
            every_token=logprobs is not None,
        )

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(
        self, out: CompletionOutput, start: int, k: int | None, offset: int = 0
    ) -> CompletionLogprobs | None:
        if k is None or out.logprobs is None:
            return None
        res = CompletionLogprobs()
        for tid, lps in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
            tok = self._token_text(tid)
            res.tokens.append(tok)
            res.token_logprobs.append(lps.get(tid))
            res.text_offset.append(offset)
            offset += len(tok)
            # The engine gives the top k and the sampled token (k + 1 entries at most, as
            # vLLM returns them; with logprobs=0, the sampled token alone).
            top = sorted(lps.items(), key=lambda kv: -kv[1])
            res.top_logprobs.append({self._token_text(t): lp for t, lp in top})
        return res

    # -- chat completions -----------------------------------------------------------------
    def _check_chat(self, req: ChatCompletionRequest) -> list[dict[str, Any]]:
        """The messages as the template gets them (``developer`` as ``system``)."""
        if not req.messages:
            raise bad_request("messages must not be empty", "messages")
        if req.tools:
            raise bad_request("tools are not supported", "tools")
        reserved = jobs.RESERVED_TEMPLATE_KWARGS & set(req.chat_template_kwargs or ())
        if reserved:
            raise bad_request(
                f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}",
                "chat_template_kwargs",
            )
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:
            if m["role"] == "developer":
                m["role"] = "system"
        return messages

    async def create_chat_completion(self, req: ChatCompletionRequest) -> Response:
        model = self.check_model(req.model)
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        messages = self._check_chat(req)
        with self.admission.admit(req.n) as ticket:
            work = self.tokenizers.encode_chat(
                messages,
                req.add_generation_prompt,
                req.chat_template_kwargs,
                self.max_prompt_chars,
                self.max_model_len,
            )
            ids = await self._tokenize(work, "messages")
            if req.max_completion_tokens is not None:
                max_tokens = self._max_tokens(
                    len(ids), req.max_completion_tokens, "max_completion_tokens"
                )
            else:
                max_tokens = self._max_tokens(len(ids), req.max_tokens, "max_tokens")
            k = (req.top_logprobs or 0) if req.logprobs else None
            params = [self._params(req, max_tokens, k, req.seed)]
            batch = await self._start("chatcmpl", model, req, [ids], params, ticket)
        if req.stream:
            include_usage, continuous = _usage_options(req)
            return _streaming(self._chat_stream(batch, k, include_usage, continuous))
        await _drain(batch)
        choices = [
            ChatCompletionChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.output.text),
                logprobs=self._chat_logprobs(c.output, 0, k),
                finish_reason=c.output.finish_reason,
                stop_reason=c.output.stop_reason,
            )
            for c in batch.choices
            if c.output is not None
        ]
        resp = ChatCompletionResponse(
            id=batch.request_id,
            model=model,
            choices=choices,
            usage=batch.usage(),
            kv_transfer_params=batch.kv_transfer_params(),
        )
        return _json(resp)

    def _chat_stream(
        self, batch: _Batch, k: int | None, include_usage: bool, continuous: bool
    ) -> AsyncIterator[str]:
        def choice(c: _Choice, out: CompletionOutput, text: str) -> ChatCompletionChunkChoice:
            return ChatCompletionChunkChoice(
                index=c.index,
                delta=DeltaMessage(content=text) if text else DeltaMessage(),
                logprobs=self._chat_logprobs(out, c.sent_tokens, k),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )

        # The role first, as OpenAI does (it also flushes the headers).
        first = [
            ChatCompletionChunkChoice(
                index=c.index, delta=DeltaMessage(role="assistant", content="")
            )
            for c in batch.choices
        ]
        return _sse_stream(
            batch,
            ChatCompletionChunk,
            choice,
            include_usage,
            continuous,
            every_token=k is not None,
            first=first,
        )

    def _chat_logprobs(
        self, out: CompletionOutput, start: int, k: int | None
    ) -> ChatChoiceLogprobs | None:
        if k is None or out.logprobs is None:
            return None
        content = []
        for tid, lps in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
            tok = self._token_text(tid)
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:k]
            content.append(
                ChatTokenLogprob(
                    token=tok,
                    logprob=lps.get(tid, float("-inf")),
                    bytes=list(tok.encode()),
                    top_logprobs=[
                        TopLogprob(
                            token=(t := self._token_text(i)), logprob=lp, bytes=list(t.encode())
                        )
                        for i, lp in top
                    ],
                )
            )
        return ChatChoiceLogprobs(content=content)


async def _drain(batch: _Batch) -> None:
    """Run a non-streaming batch to completion (engine failures become HTTP 500)."""
    try:
        async for _ in batch.outputs():
            pass
    except APIError:
        raise
    except Exception as exc:
        raise APIError(f"generation failed: {exc}", 500) from exc
    finally:
        batch.abort()


def _usage_options(req: SamplingFields) -> tuple[bool, bool]:
    """(usage chunk at the end, usage on every chunk): vLLM's rule, the second needs the first."""
    opts = req.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts and opts.continuous_usage_stats)


def _running_usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


async def _sse_stream(
    batch: _Batch,
    chunk_type: type[CompletionResponse] | type[ChatCompletionChunk],
    choice: Callable[[_Choice, CompletionOutput, str], Any],
    include_usage: bool,
    continuous_usage: bool,
    *,
    every_token: bool,
    first: list[Any] | None = None,
) -> AsyncIterator[str]:
    """The SSE events of a streamed batch: ``first`` choices, then a chunk per choice that
    produced text (or a token, with ``every_token``), the usage chunk, ``[DONE]``. With
    ``continuous_usage`` every chunk also carries its choice's usage so far (as vLLM's
    ``continuous_usage_stats``). An engine failure becomes an error event; the batch is
    aborted however the stream ends."""
    created = int(time.time())

    def chunk(choices: list[Any], usage: Usage | None = None) -> str:
        return chunk_type(
            id=batch.request_id, created=created, model=batch.model, choices=choices, usage=usage
        ).model_dump_json()

    try:
        if first:
            c0 = batch.choices[0]
            yield _sse(
                chunk(first, _running_usage(c0.num_prompt_tokens, 0) if continuous_usage else None)
            )
        async for c in batch.outputs():
            out = c.output
            assert out is not None
            text = out.text[c.sent_text :]
            if not text and not out.finished() and not every_token:
                continue
            ch = choice(c, out, text)
            c.sent_text, c.sent_tokens = len(out.text), len(out.token_ids)
            usage = None
            if continuous_usage:
                usage = _running_usage(c.num_prompt_tokens, len(out.token_ids))
            yield _sse(chunk([ch], usage))
        if include_usage:
            yield _sse(chunk([], batch.usage()))
    except Exception as exc:
        yield _sse(_error_body(exc))
    finally:
        batch.abort()
    yield _sse("[DONE]")


def _error_body(exc: BaseException) -> str:
    err = exc if isinstance(exc, APIError) else APIError(f"generation failed: {exc}", 500)
    return err.body().model_dump_json()


def _json(body: BaseModel) -> Response:
    # pydantic writes non-finite floats (a -inf logprob) as null instead of failing.
    return Response(body.model_dump_json(), media_type="application/json")


def _streaming(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream")
