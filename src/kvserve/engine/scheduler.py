"""Continuous batching: which requests compute how many tokens each step, and their lifecycle.

Owns the waiting and running queues, the per-step token budget (chunked prefill), preemption
by recompute, stop conditions, and the scheduler side of the KV connector protocol (external
hits, asynchronous loads, blocks held for stores, failed loads). Block bookkeeping is delegated
to :class:`~kvserve.engine.kv_cache_manager.KVCacheManager`; tensors are never touched here.

One step is ``schedule()`` -> the model runner -> ``update_from_output()``; call
``update_from_output`` after every ``schedule`` (even an empty one): it is also where
connector completions are learned and where requests rejected at admission are reported.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from kvserve.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.engine.request import Request, RequestStatus
from kvserve.kv.connector import KVConnectorBase, KVConnectorOutput

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kvs: int
    num_held: int  # finished requests whose blocks a connector still reads
    kv_cache_usage: float
    num_free_blocks: int
    num_preemptions: int  # cumulative
    prefix_cache: PrefixCacheStats


class Scheduler:
    """FCFS continuous-batching scheduler with chunked prefill and preemption by recompute."""

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        connector: KVConnectorBase | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.connector = connector
        self.block_size = kv_cache_manager.block_size
        self.max_model_len = kv_cache_manager.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        # A request stops once it has this many tokens: the next one would not fit in the
        # model (max_model_len) or in the whole pool (the last token's KV needs no slot).
        self.max_len = min(self.max_model_len, kv_cache_manager.max_num_tokens + 1)

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished requests whose blocks the connector still reads (until finished_sending).
        self.held: dict[str, Request] = {}
        # Ids finished since the last schedule() (the runner drops their state).
        self.finished_req_ids: set[str] = set()
        # Rejected at admission, reported by the next update_from_output().
        self._ignored: list[Request] = []
        # Running requests restarted by a failed load (see _handle_invalid_blocks).
        self._restarted: set[str] = set()
        # Admitted with a synchronous external load this step: cache their blocks after it.
        self._cache_after_step: set[str] = set()
        # Waiting for an asynchronous KV load (WAITING_FOR_REMOTE_KVS): they hold blocks and
        # the connector's staging room, so they count against max_num_seqs with the running.
        self._loading: set[str] = set()
        self.num_preemptions = 0

    # -- requests in and out --------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests or rid in self.held:
            raise ValueError(f"request id {rid!r} is already in use")
        reason = self._reject_reason(request)
        if reason is not None:
            logger.warning("ignoring request %s: %s", rid, reason)
            request.status = RequestStatus.FINISHED_IGNORED
            request.times.finished = time.monotonic()
            self._ignored.append(request)
            return
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.append(request)

    def _reject_reason(self, request: Request) -> str | None:
        n = request.num_tokens
        if n == 0:
            return "empty prompt"
        if n > self.max_model_len:
            return f"{n} tokens exceed max_model_len {self.max_model_len}"
        if self.kv.max_blocks_for(n) > self.kv.num_usable_blocks:
            return f"{n} tokens exceed the whole KV pool ({self.kv.max_num_tokens} tokens)"
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            return (
                f"{n} tokens exceed max_num_batched_tokens {self.max_num_batched_tokens} "
                "and chunked prefill is disabled"
            )
        return None

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside (abort, stop string) in any state; frees their blocks."""
        if not finished_status.finished:
            raise ValueError(f"{finished_status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._loading.discard(rid)
            request.status = finished_status
            self._finish(request)

    def _finish(self, request: Request) -> None:
        """Bookkeeping of a request that just got a finished status."""
        rid = request.request_id
        request.times.finished = time.monotonic()
        del self.requests[rid]
        self._cache_after_step.discard(rid)
        self.finished_req_ids.add(rid)
        block_ids = self.kv.get_block_ids(rid)
        held = False
        if self.connector is not None:
            held = self.connector.request_finished(request, block_ids)
            if request.kv_transfer_params is not None:
                request.finished_kv_transfer_params = (
                    self.connector.get_finished_kv_transfer_params(request)
                )
        if held:
            self.held[rid] = request
        else:
            self.kv.free(request)

    def _release_held(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            request = self.held.pop(rid, None)
            if request is not None:
                self.kv.free(request)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        num_scheduled = out.num_scheduled_tokens

        # 1. Running requests: decodes and continuing chunked prefills, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while True:
                if self.kv.allocate_slots(request, num_new) is not None:
                    scheduled_running.append(request)
                    num_scheduled[request.request_id] = num_new
                    budget -= num_new
                    i += 1
                    break
                victim = max(range(len(self.running)), key=lambda j: (self.running[j].priority, j))
                preempted = self.running.pop(victim)
                if victim < i:
                    i -= 1
                if preempted.request_id in num_scheduled:  # undo its part of this step
                    budget += num_scheduled.pop(preempted.request_id)
                    scheduled_running.remove(preempted)
                self._preempt(preempted)
                out.preempted_req_ids.add(preempted.request_id)
                if preempted is request:
                    break

        # 2. Waiting requests, FCFS, unless this step had to preempt.
        if not out.preempted_req_ids:
            budget = self._schedule_waiting(out, budget, scheduled_new)

        # Batch order: decodes first, then prefills.
        batch = scheduled_running + scheduled_new
        decodes = [r for r in batch if self._is_decode(r, num_scheduled[r.request_id])]
        prefills = [r for r in batch if not self._is_decode(r, num_scheduled[r.request_id])]
        out.scheduled = decodes + prefills
        if self.kv.num_groups == 1:
            out.block_ids = {
                r.request_id: self.kv.get_block_ids(r.request_id) for r in out.scheduled
            }
        else:
            groups = out.group_block_ids
            for r in out.scheduled:
                tables = groups[r.request_id] = self.kv.get_group_block_ids(r.request_id)
                out.block_ids[r.request_id] = tables[0]
        out.total_num_scheduled_tokens = sum(num_scheduled.values())
        assert out.total_num_scheduled_tokens <= self.max_num_batched_tokens
        assert len(self.running) <= self.max_num_seqs
        out.finished_req_ids = self.finished_req_ids
        self.finished_req_ids = set()
        if self._restarted:  # restarted by the last step's results: flushed like preemptions
            out.preempted_req_ids |= self._restarted
            self._restarted = set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    @staticmethod
    def _is_decode(request: Request, num_scheduled: int) -> bool:
        return num_scheduled == 1 and request.num_computed_tokens == request.num_tokens - 1

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: int, scheduled_new: list[Request]
    ) -> int:
        skipped: list[Request] = []
        num_scheduled = out.num_scheduled_tokens
        # Requests back from a KV load hold their prompt's blocks: they go first, so that a
        # request needing new blocks never waits (with nothing running) for blocks they hold.
        ready = [
            r
            for r in self.waiting
            if r.status == RequestStatus.WAITING and self.kv.get_blocks(r.request_id)
        ]
        if ready:
            ids = {id(r) for r in ready}
            self.waiting = deque(ready + [r for r in self.waiting if id(r) not in ids])
        connector = self.connector
        loading = self._loading
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            rid = request.request_id
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(self.waiting.popleft())
                continue

            if self.kv.get_blocks(rid):
                # Back from an asynchronous load: its blocks and computed tokens are set.
                num_external, load_async = 0, False
                num_new = request.num_tokens - request.num_computed_tokens
                if not self._fits_budget(request, num_new, budget):
                    break
                num_new = min(num_new, budget)
                if self.kv.allocate_slots(request, num_new) is None:
                    break
            else:
                if len(self.running) + len(loading) >= self.max_num_seqs:
                    # Requests loading KV count as running: no more admissions this step.
                    break
                hit_blocks, num_hit = self.kv.get_computed_blocks(request)
                num_external, load_async = 0, False
                if connector is not None:
                    matched, load_async = connector.get_num_new_matched_tokens(request, num_hit)
                    if matched is None:
                        # The connector is still looking (a storage tier): ask next step,
                        # schedule the requests behind this one meanwhile.
                        skipped.append(self.waiting.popleft())
                        continue
                    # Never recompute less than one token.
                    num_external = matched
                    num_external = max(0, min(num_external, request.num_tokens - 1 - num_hit))
                    load_async = load_async and num_external > 0
                num_computed = num_hit + num_external
                if load_async:
                    num_new = 0
                    # Reserve the rest of the prompt now, so the request can run once loaded.
                    num_alloc = request.num_tokens - num_computed
                else:
                    num_new = request.num_tokens - num_computed
                    if not self._fits_budget(request, num_new, budget):
                        break
                    num_new = min(num_new, budget)
                new_blocks = self.kv.allocate_slots(
                    request,
                    num_alloc if load_async else num_new,
                    num_hit,
                    hit_blocks,
                    num_external_computed_tokens=num_external,
                    delay_cache_blocks=num_external > 0,
                )
                if new_blocks is None:
                    break
                if connector is not None:
                    # The connector sees the primary hit as num_computed_tokens; its
                    # num_external tokens follow it in the block table.
                    request.num_computed_tokens = num_hit
                    connector.update_state_after_alloc(
                        request, self.kv.get_block_ids(rid), num_external
                    )
                    if num_hit:
                        connector.touch([b.block_hash for b in hit_blocks[0] if b.block_hash])
                request.num_computed_tokens = num_computed
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit
                    request.num_external_computed_tokens = num_external
                if request.times.first_scheduled is None:
                    request.times.first_scheduled = time.monotonic()

            self.waiting.popleft()
            if load_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                loading.add(rid)
                skipped.append(request)
                continue
            if num_external > 0:
                self._cache_after_step.add(rid)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled_new.append(request)
            num_scheduled[rid] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _fits_budget(self, request: Request, num_new: int, budget: int) -> bool:
        """Without chunked prefill a first prefill runs whole (a recompute may be chunked)."""
        if self.enable_chunked_prefill or num_new <= budget:
            return True
        return request.num_preemptions > 0 and budget == self.max_num_batched_tokens

    def _restart(self, request: Request) -> None:
        """Free every block of ``request`` and queue it to be computed from its first token
        (a running one as a preemption: the connector finishes stores from its blocks first,
        at the next step)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._preempt(request)
            self._restarted.add(request.request_id)
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
        # What the first admission served is void: the next one reports its own hits.
        request.num_cached_tokens = -1
        request.num_external_computed_tokens = 0

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        self._cache_after_step.discard(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- results --------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply one step's results; returns requests that got new tokens or finished."""
        mro = model_runner_output
        changed: list[Request] = self._ignored
        self._ignored = []

        if self.connector is not None and (
            mro.finished_sending or mro.finished_recving or mro.invalid_block_ids
        ):
            self.connector.update_connector_output(
                KVConnectorOutput(
                    finished_sending=set(mro.finished_sending),
                    finished_recving=set(mro.finished_recving),
                    invalid_block_ids=set(mro.invalid_block_ids),
                )
            )
        rolled_back = (
            self._handle_invalid_blocks(mro.invalid_block_ids) if (mro.invalid_block_ids) else set()
        )

        now = time.monotonic()
        for request in scheduler_output.scheduled:
            rid = request.request_id
            if request.is_finished or self.requests.get(rid) is not request:
                continue  # finished from outside since schedule()
            if rid in rolled_back or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += scheduler_output.num_scheduled_tokens[rid]
            if rid in self._cache_after_step:
                self._cache_after_step.discard(rid)
                self.kv.cache_blocks(request, request.num_computed_tokens)
            if request.num_computed_tokens < request.num_tokens:
                continue  # partial prefill: anything sampled is discarded
            sampled = mro.sampled_token_ids.get(rid) or []
            logprobs = mro.logprobs.get(rid)
            for k, token_id in enumerate(sampled):
                request.append_output_token(token_id)
                if logprobs is not None and k < len(logprobs):
                    request.output_logprobs.append(logprobs[k])
                if self._check_stop(request):
                    break
            if sampled:
                if request.times.first_token is None:
                    request.times.first_token = now
                request.times.last_token = now
                changed.append(request)
            if request.is_finished:
                self.running.remove(request)
                self._finish(request)

        # Connector completions: loads finished -> schedulable; stores finished -> release.
        for rid in mro.finished_recving:
            request = self.requests.get(rid)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.kv.cache_blocks(request, request.num_computed_tokens)
                request.status = RequestStatus.WAITING
                self._loading.discard(rid)
        self._release_held(mro.finished_recving)
        self._release_held(mro.finished_sending)

        if self.config.debug:
            self.check_integrity()
        return changed

    def _check_stop(self, request: Request) -> bool:
        """Set a finished status if the last sampled token ends the request."""
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        if request.num_tokens >= self.max_len or (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> set[str]:
        """A failed load left wrong KV in these blocks: uncache them; the requests that hold
        them recompute from their first invalid block. Returns running requests rolled back
        (their step's results are discarded)."""
        rolled_back: set[str] = set()
        for request in list(self.requests.values()):
            first_bad = None
            for blocks in self.kv.get_group_block_ids(request.request_id):
                bad = next((k for k, b in enumerate(blocks) if b in invalid_block_ids), None)
                if bad is not None and (first_bad is None or bad < first_bad):
                    first_bad = bad
            if first_bad is None:
                continue
            self.kv.uncache_from(request, first_bad)
            valid_tokens = first_bad * self.block_size
            logger.warning(
                "request %s: KV load failed at block %d, recomputing from token %d",
                request.request_id,
                first_bad,
                valid_tokens,
            )
            if request.status == RequestStatus.RUNNING:
                rolled_back.add(request.request_id)
                self._cache_after_step.discard(request.request_id)
            request.num_computed_tokens = min(request.num_computed_tokens, valid_tokens)
            if not self.kv.can_resume_at(request.request_id, request.num_computed_tokens):
                # A sliding group holds only the window of the load's end (the null block
                # before it): recomputing from here would write and read the null block.
                # Start over, from a fresh lookup.
                self._restart(request)
                continue
            # Report only what was really served from outside the primary pool.
            if request.num_external_computed_tokens > 0:
                hit = max(0, request.num_cached_tokens)
                request.num_external_computed_tokens = max(
                    0, min(request.num_external_computed_tokens, valid_tokens - hit)
                )
        self.kv.evict_blocks(invalid_block_ids)
        return rolled_back

    # -- state ----------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or rejections not yet reported by update_from_output."""
        return self.get_num_unfinished_requests() > 0 or bool(self._ignored)

    def has_finished_requests(self) -> bool:
        """Finished ids not yet sent to the runner, or blocks held for a connector transfer."""
        return bool(self.finished_req_ids) or bool(self.held)

    def has_requests(self) -> bool:
        """Keep stepping while this is true (also drives connector completions)."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def take_events(self) -> list:
        return self.kv.take_events()

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_for_remote_kvs=sum(
                r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting
            ),
            num_held=len(self.held),
            kv_cache_usage=self.kv.usage,
            num_free_blocks=self.kv.get_num_free_blocks(),
            num_preemptions=self.num_preemptions,
            prefix_cache=self.kv.make_prefix_cache_stats(),
        )

    def check_integrity(self) -> None:
        """Pool and table invariants; with no request alive, every block must be free."""
        self.kv.check_integrity()
        live = set(self.requests) | set(self.held)
        stale = set(self.kv.req_to_blocks) - live
        if stale:
            raise AssertionError(f"blocks leaked by finished requests: {sorted(stale)}")
        for request in self.running:
            if request.status != RequestStatus.RUNNING:
                raise AssertionError(f"{request} is in the running queue")
        if not live and self.kv.get_num_free_blocks() != self.kv.num_usable_blocks:
            raise AssertionError(
                f"no request alive but only {self.kv.get_num_free_blocks()} of "
                f"{self.kv.num_usable_blocks} blocks are free"
            )
