"""LLMEngine: one engine instance, stepped synchronously.

Owns the wiring of tokenizer -> scheduler -> (KV connector) -> model runner -> detokenizer,
input validation, stop strings, and the per-step RequestOutputs. It does not own threads
(see ``async_engine``) or HTTP (see ``server``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import EngineConfig, GiB
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.outputs import (
    CompletionOutput,
    ModelRunnerOutput,
    RequestMetrics,
    RequestOutput,
)
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.connector import KVConnectorOutput, KVConnectorStats, create_connector
from kvserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

# Longest sleep on KV transfers in a step that computed nothing (the connector returns as soon
# as one ends).
TRANSFER_WAIT_S = 0.002


@dataclass
class EngineStats:
    """A snapshot for metrics and routers (counters are totals since start)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of primary blocks in use by requests
    num_kv_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the primary prefix cache
    prefix_cache_hits: int = 0  # of which were hits
    num_preemptions: int = 0
    connector: KVConnectorStats = field(default_factory=KVConnectorStats)


class _RequestState:
    """Engine-side per-request state: detokenizer, stop-string bookkeeping, logprobs.

    ``text`` is everything decoded so far (cut at a stop string once one is found);
    ``visible`` how much of it outputs have shown: while the request runs, a tail of
    ``text`` that could still grow into a stop string is held back, so streamed text is
    always a prefix of the final text.
    """

    __slots__ = ("request", "detok", "text", "visible", "sent_tokens", "logprobs", "cum_logprob")

    def __init__(self, request: Request, detok: IncrementalDetokenizer) -> None:
        self.request = request
        self.detok = detok
        self.text = ""
        self.visible = 0
        self.sent_tokens = 0
        self.logprobs: list[dict[int, float]] = []
        self.cum_logprob = 0.0


class LLMEngine:
    """Synchronous engine: ``add_request`` then call ``step`` until nothing is unfinished."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        """``runner`` replaces the model runner (the simulator passes a latency model)."""
        if not config.model:
            raise ValueError("EngineConfig.model (a local model directory) is required")
        self.config = config
        self.tokenizer = Tokenizer(config.tokenizer or config.model)
        self.runner = runner if runner is not None else ModelRunner(config)
        mc = self.runner.model_config
        self.model_name = config.served_model_name or dir_name(config.model)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        block_bytes = self.runner.kv_block_bytes()
        if config.num_kv_blocks is not None:
            num_blocks = int(config.num_kv_blocks)
        else:
            num_blocks = int(config.kv_cache_memory * GiB // block_bytes)
        if num_blocks < 2:
            raise ValueError(
                f"KV pool too small: {num_blocks} blocks of {block_bytes} bytes; raise "
                "kv_cache_memory or num_kv_blocks"
            )
        self.num_kv_blocks = num_blocks
        self.kv_cache = self.runner.allocate_kv_cache(num_blocks)
        self.events_enabled = bool(config.kv_events_endpoint) or config.enable_kv_cache_events
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            enable_caching=config.enable_prefix_caching,
            enable_kv_cache_events=self.events_enabled,
            kv_cache_groups=getattr(self.runner, "kv_cache_groups", None),
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.connector = create_connector(config)
        bind = getattr(self.connector, "bind_kv_cache_manager", None)
        if bind is not None:  # a connector that stores and loads per KV cache group
            bind(self.kv_cache_manager)
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv_cache)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.connector)
        self.eos_token_id = self.tokenizer.eos_token_id
        self._extra_eos = [t for t in mc.eos_token_id if t != self.eos_token_id]
        self._states: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        logger.info(
            "engine ready: model=%s device=%s dtype=%s blocks=%d x %d tokens (%.1f MiB)",
            self.model_name,
            self.runner.device,
            self.runner.dtype,
            num_blocks,
            config.block_size,
            num_blocks * block_bytes / (1 << 20),
        )

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> str:
        """Validate and enqueue one request (``params.n`` must be 1: callers fan out).

        ``kv_transfer_params`` follows vLLM's P/D contract (``do_remote_decode`` on a prefill
        engine, the returned parameters with ``do_remote_prefill`` on a decode engine); an
        engine without a KV connector ignores them."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._states:
            raise ValueError(f"duplicate request id {request_id!r}")
        if params.n != 1:
            raise ValueError("LLMEngine takes n=1 requests; fan out n in the caller")
        params = dataclasses.replace(params)  # ours to complete; callers may share theirs
        text: str | None = None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.runner.model_config.vocab_size
            # C-speed checks: long token-id prompts are common (routers, benchmarks).
            if token_ids and (
                not set(map(type, token_ids)) <= {int}
                or min(token_ids) < 0
                or max(token_ids) >= vocab
            ):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not token_ids:
            raise ValueError("prompt is empty")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens; this model's maximum context length is "
                f"{self.max_model_len} and at least one token must be generated"
            )
        pool_tokens = self.scheduler.max_len - 1  # the whole KV pool, less the next token
        if n > pool_tokens:
            raise ValueError(
                f"prompt has {n} tokens; this server's KV cache holds at most {pool_tokens} "
                "tokens for one request"
            )
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - n
        elif n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum "
                f"context length {self.max_model_len}"
            )
        if kv_transfer_params is not None:
            if not isinstance(kv_transfer_params, dict):
                raise ValueError("kv_transfer_params must be an object")
            if self.connector is not None:
                self.connector.check_kv_transfer_params(kv_transfer_params)
        if self._extra_eos and not params.ignore_eos:
            # generation_config.json may list several EOS ids (Llama 3): all of them stop.
            params.stop_token_ids = list(dict.fromkeys([*params.stop_token_ids, *self._extra_eos]))
        req = Request(
            request_id,
            token_ids,
            params,
            block_size=self.config.block_size,
            eos_token_id=self.eos_token_id,
            prefix_hash_seed=self.config.prefix_hash_seed,
            cache_salt=cache_salt,
            prompt=text,
            kv_transfer_params=kv_transfer_params,
        )
        self._states[request_id] = _RequestState(
            req, IncrementalDetokenizer(self.tokenizer, token_ids)
        )
        self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort unfinished requests; returns each one's final output (``finish_reason``
        ``"abort"``, the tokens and text produced so far)."""
        ids = [r for r in request_ids if r in self._states]
        if not ids:
            return []
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        outs = []
        for rid in ids:
            st = self._states.pop(rid)
            outs.append(self._request_output(st, st.request, [], "", True))
        return outs

    def has_unfinished_requests(self) -> bool:
        # Includes finished requests whose blocks a connector store still holds, and a
        # connector's own work in flight (writes to storage tiers): stepping applies it.
        conn = self.connector
        return self.scheduler.has_requests() or (conn is not None and conn.has_pending_work())

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        meta = sched_out.kv_connector_metadata
        conn = self.connector
        if conn is not None and conn.idle_step(meta):
            conn = None  # nothing to do this step (most decode steps): one call, not five
        if conn is not None:
            conn.handle_preemptions(sched_out.preempted_req_ids)
            conn.start_load_kv(meta)
        if sched_out.is_empty:
            runner_out = ModelRunnerOutput()
        else:
            runner_out = self.runner.execute_model(sched_out)
        # Nothing computed, yet requests are pending: they wait for KV transfers (loads, or
        # stores holding finished requests' blocks). Sleep on those instead of spinning.
        idle = sched_out.is_empty and self.has_unfinished_requests()
        waited = False
        if conn is not None:
            conn.wait_for_save(meta)
            if idle:
                waited = conn.wait_for_transfers(TRANSFER_WAIT_S)
            co: KVConnectorOutput = conn.get_finished(sched_out.finished_req_ids)
            runner_out.finished_sending |= co.finished_sending
            runner_out.finished_recving |= co.finished_recving
            runner_out.invalid_block_ids |= co.invalid_block_ids
        updated = self.scheduler.update_from_output(sched_out, runner_out)
        if idle and not waited and not updated:
            time.sleep(0.0005)  # no transfer to sleep on: do not spin the CPU
        return self._make_outputs(updated, runner_out)

    def _make_outputs(
        self, updated: list[Request], runner_out: ModelRunnerOutput
    ) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for req in updated:
            st = self._states.get(req.request_id)
            if st is None:
                continue
            new_ids = req.output_token_ids[st.sent_tokens :]
            lps = runner_out.logprobs.get(req.request_id)
            if lps and req.sampling_params.logprobs is not None:
                for sampled_lp, top in lps:
                    st.cum_logprob += sampled_lp
                    st.logprobs.append(top)
            new_text = self._detokenize(st, req, new_ids)
            st.sent_tokens = len(req.output_token_ids)
            finished = req.is_finished
            if finished:
                self._states.pop(req.request_id, None)
            outputs.append(self._request_output(st, req, new_ids, new_text, finished))
        return outputs

    def _detokenize(self, st: _RequestState, req: Request, new_ids: list[int]) -> str:
        """Extend ``st.text`` with ``new_ids``, apply stop strings; return the newly visible
        text (the delta outputs stream)."""
        sp = req.sampling_params
        ids = new_ids
        stopped_by_token = req.status == RequestStatus.FINISHED_STOPPED and not isinstance(
            req.stop_reason, str
        )
        if ids and stopped_by_token:
            ids = ids[:-1]  # the EOS / stop token itself is not part of the text
        new_text = st.detok.add_tokens(ids) if ids else ""
        if req.is_finished:
            new_text += st.detok.flush()
        if sp.stop and new_text:
            # A stop string may straddle the previous text: search the tail only.
            tail = max(len(s) for s in sp.stop) - 1
            start = max(0, len(st.text) - tail)
            window = st.text[start:] + new_text
            hit = _find_stop(window, sp.stop)
            if hit is not None:
                pos, stop = hit
                cut = pos + (len(stop) if sp.include_stop_str_in_output else 0)
                st.text = st.text[:start] + window[:cut]
                if not req.is_finished:
                    self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop
            else:
                st.text += new_text
        else:
            st.text += new_text
        visible = len(st.text)
        if sp.stop and not sp.include_stop_str_in_output and not req.is_finished:
            # Text that may yet become a stop string is not shown (it would be cut).
            # With include_stop_str_in_output everything shown stays: a stop's text is kept.
            visible -= _partial_stop_len(st.text, sp.stop)
        delta = st.text[st.visible : visible]
        st.visible = max(st.visible, visible)
        return delta

    def _request_output(
        self, st: _RequestState, req: Request, new_ids: list[int], new_text: str, finished: bool
    ) -> RequestOutput:
        sp = req.sampling_params
        t = req.times
        metrics = RequestMetrics(
            arrival_time=t.arrival,
            first_scheduled_time=t.first_scheduled,
            first_token_time=t.first_token,
            last_token_time=t.last_token,
            finished_time=t.finished if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_external_cached_tokens=req.num_external_computed_tokens,
            num_computed_prompt_tokens=req.num_prompt_tokens
            - max(req.num_cached_tokens, 0)
            - req.num_external_computed_tokens,
            num_preemptions=req.num_preemptions,
        )
        if finished and metrics.finished_time is None:
            metrics.finished_time = time.monotonic()
        comp = CompletionOutput(
            index=0,
            text=st.text[: st.visible],
            token_ids=list(req.output_token_ids),
            cumulative_logprob=st.cum_logprob if sp.logprobs is not None else None,
            logprobs=list(st.logprobs) if sp.logprobs is not None else None,
            finish_reason=req.status.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[comp],
            finished=finished,
            metrics=metrics,
            new_token_ids=list(new_ids),
            new_text=new_text,
            kv_transfer_params=req.finished_kv_transfer_params if finished else None,
        )

    # ------------------------------------------------------------------ state
    def get_stats(self) -> EngineStats:
        s = self.scheduler
        kvm = self.kv_cache_manager
        pstats = kvm.prefix_cache_stats
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=kvm.usage,
            num_kv_blocks=self.num_kv_blocks,
            prefix_cache_queries=pstats.queries,
            prefix_cache_hits=pstats.hits,
            num_preemptions=s.num_preemptions,
            connector=self.connector.stats() if self.connector else KVConnectorStats(),
        )

    def take_kv_events(self) -> list:
        events = self.kv_cache_manager.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        return events

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()


def _find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    if not text:
        return 0
    last = text[-1]
    best = 0
    for s in stops:
        # Candidates end where ``s`` has the text's last character, longest first.
        k = s.rfind(last, 0, len(s) - 1)
        while k + 1 > best:
            if text.endswith(s[: k + 1]):
                best = k + 1
                break
            k = s.rfind(last, 0, k)
    return best


def dir_name(path: str) -> str:
    """The served model name a model directory gets by default (its last path part)."""
    from pathlib import Path

    return Path(path).resolve().name
