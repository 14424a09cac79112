"""The offloading connector's scheduler side: decisions, in the scheduler's thread; owns the
:class:`~kvserve.kv.offload.manager.OffloadingManager`'s reservations.

- lookup: after the primary-pool prefix hit, the request's following chunks that the tier
  holds (a chunk is ``kv_offload_block_size`` tokens = ``k`` engine blocks, keyed by the hash
  of its last block). When the primary hit ends inside a chunk, only that chunk's blocks past
  the hit are loaded. At most ``num_tokens - 1`` tokens are claimed. Loads are always
  asynchronous: the request waits in WAITING_FOR_REMOTE_KVS while others compute.
- stores: each step, chunks that the step's forward completes are reserved in the tier, all
  requests' in one ``prepare_store``, and copied after sampling (``wait_for_save``) as one job
  of columns (:class:`~kvserve.kv.offload.worker.WholeChunks`), never delaying tokens.
  Requests are looked at only in the step their next chunk can fill (``_due``), not in a pass
  over every running request; a step with nothing due, no prefill and nothing to start
  returns shared metadata at once.
- a request has one load job or several store jobs in flight, never both; a finished request
  whose jobs are in flight keeps its blocks until they end (reported in ``finished_sending``).

:class:`SchedulerSide` is a part of :class:`~kvserve.kv.offload.connector.OffloadingConnector`
(its state is the connector's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.kv.offload.connector_state import (
    JobRecord,
    LookupResult,
    OffloadConnectorMetadata,
    RequestState,
)
from kvserve.kv.offload.manager import LoadSpec
from kvserve.kv.offload.storage_worker import ReadItem
from kvserve.kv.offload.worker import ChunkCopy, TransferJob, WholeChunks

if TYPE_CHECKING:
    from kvserve.engine.outputs import SchedulerOutput
    from kvserve.engine.request import Request


class SchedulerSide:
    """Lookups, loads after allocation, store planning, request ends (methods of the
    connector)."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._lookups.pop(rid, None)
        st = self._reqs.get(rid)
        if st is not None and (st.store_jobs or st.load_job is not None):
            return 0, False  # never a load while this request's jobs are in flight
        bs, k = self.block_size, self.blocks_per_chunk
        if num_computed_tokens % bs:
            return 0, False
        first = num_computed_tokens // bs // k
        n_chunks = len(request.block_hashes) // k
        if first >= n_chunks:
            return 0, False
        # Only chunks that end before the last prompt token can be used.
        n_usable = min(n_chunks, (request.num_tokens - 1) // self.chunk_tokens + 1)
        sources: list[int] = []
        if self.per_group:
            hits = self._group_hits(request, first, n_usable)
            if self.storage is not None and first + hits < n_usable:
                if not self._stage_group_hits(rid, request, first, n_usable):
                    return None, False  # storage lookup or staging in flight: ask again
                hits = self._group_hits(request, first, n_usable)
            keys = []
        else:
            keys = self._chunk_keys(request, first, n_usable)
            hits = self._mgr().lookup(keys)
        if self.storage is not None and hits < len(keys):
            lower = self._tier_lookup(rid, first + hits, keys[hits:])
            if lower is None:
                return None, False  # lookup in flight: ask again next step
            sources = self._stageable(rid, lower)
            if sources is None:
                return None, False  # host slots to stage into free up soon: ask again
        end = min((first + hits + len(sources)) * self.chunk_tokens, request.num_tokens - 1)
        num_external = end - num_computed_tokens
        if num_external < bs:  # less than a block: recomputing beats a round trip
            return 0, False
        self._lookups[rid] = LookupResult(num_computed_tokens, num_external, sources, hits)
        return num_external, True

    def _forget_lookup(self, rid: str) -> LookupResult | None:
        """Drop what the lookups of ``rid`` left (the request was allocated or ended): its
        answer (returned), its wait for host slots, its group stage, its storage-tier lookup
        (a result still in flight is ignored when it comes)."""
        lookup = self._lookups.pop(rid, None)
        self._room_waits.pop(rid, None)
        self._drop_stage(rid)
        tl = self._tier_lookups.pop(rid, None)
        if tl is not None:
            self._lookup_ops.pop(tl.op_id, None)
        return lookup

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        lookup = self._forget_lookup(rid)
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = RequestState(request)
        st.request, st.next_store_chunk, st.finished = request, 0, False
        self._check_at(rid, st, self._step + 1)  # the step being scheduled
        num_computed = lookup.num_computed_tokens if lookup else request.num_computed_tokens
        s = self._stats
        s.lookups += 1
        s.lookup_query_tokens += max(0, request.num_tokens - 1 - num_computed)
        s.lookup_hit_tokens += max(0, num_external_tokens)
        if num_external_tokens <= 0:
            return
        if lookup is None:
            raise RuntimeError(f"request {rid}: external tokens without a lookup")
        bs, k = self.block_size, self.blocks_per_chunk
        start_block = num_computed // bs
        end_block = -(-(num_computed + num_external_tokens) // bs)
        first, last = start_block // k, (end_block - 1) // k
        if self.per_group:
            self._group_load(request, st, first, last, start_block, end_block)
            return
        keys = self._chunk_keys(request, first, last + 1)
        mgr = self._mgr()
        # Host hits cannot shrink within one schedule(); guard anyway.
        hits = min(mgr.lookup(keys), lookup.cpu_chunks)
        spec = mgr.prepare_load(keys[:hits]) if hits else LoadSpec([])
        slots = list(spec.slots)
        # Storage-tier hits after them: reserve host slots to stage them in (like a store);
        # a chunk that cannot be reserved ends the run (the rest is recomputed).
        sources = lookup.tier_sources[: len(keys) - hits] if hits == lookup.cpu_chunks else []
        staged_keys: list[bytes] = []
        reads: list[ReadItem] = []
        if sources:
            want = keys[hits : hits + len(sources)]
            metas = (
                [self._chunk_meta(request, first + hits + j) for j in range(len(want))]
                if self.emit_events
                else None
            )
            out = mgr.prepare_store(want, metas)
            reserved = out.keys_to_store if out is not None else []
            n = 0
            while n < len(reserved) and reserved[n] == want[n]:
                n += 1
            if n < len(reserved):
                mgr.complete_store(reserved[n:], success=False)
            staged_keys = want[:n]
            slot_u8 = self.tier.slots_u8
            for key, slot, t in zip(staged_keys, out.slots if out else [], sources, strict=False):
                slots.append(slot)
                reads.append(ReadItem(t, key, memoryview(slot_u8[slot].numpy())))
        chunks: list[ChunkCopy] = []
        missing: list[int] = []
        for j, i in enumerate(range(first, last + 1)):
            b0, b1 = max(start_block, i * k), min(end_block, (i + 1) * k)
            if j < len(slots):
                chunks.append(ChunkCopy(slots[j], keys[j], block_ids[b0:b1], b0 - i * k))
            else:
                missing.extend(block_ids[b0:b1])
        job = TransferJob(next(self._job_ids), is_store=False, chunks=chunks)
        self._jobs[job.job_id] = JobRecord(job, rid, missing, staged_keys, hits)
        if reads:
            self._reads_to_start.append((job.job_id, reads))
        else:
            self._loads_to_start.append(job)
        st.load_job = job.job_id

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadConnectorMetadata:
        step = self._step = self._step + 1
        total = scheduler_output.total_num_scheduled_tokens
        scheduled = scheduler_output.scheduled
        extra = total - len(scheduled)  # tokens beyond one per request: prefills
        due = self._due.pop(step, None)
        if due is None and extra <= 0 and not self._loads_to_start and not self._reads_to_start:
            return self._quiet_meta[total > 0]  # most decode steps: nothing to start or plan
        meta = OffloadConnectorMetadata(
            loads=self._loads_to_start, reads=self._reads_to_start, forward=total > 0
        )
        self._loads_to_start, self._reads_to_start = [], []
        num_scheduled = scheduler_output.num_scheduled_tokens
        # Requests that may complete a chunk this step: those due now, and those computing
        # more than one token (prefills). The latter are found from the end of the batch
        # (the scheduler puts prefills last) until their extra tokens are all accounted for.
        check: dict[str, Request] = {}
        reqs = self._reqs
        for rid in due or ():
            st = reqs.get(rid)
            if st is not None and st.due == step:
                check[rid] = st.request
        i = len(scheduled)
        while extra > 0 and i > 0:
            i -= 1
            request = scheduled[i]
            n = num_scheduled[request.request_id]
            if n > 1:
                check[request.request_id] = request
                extra -= n - 1
        if not check:
            return meta
        chunks = WholeChunks(self.blocks_per_chunk)
        store_reqs: list[str] = []
        pins: list[int] = []
        if self.per_group:
            for rid, request in check.items():
                span = self._store_span(rid, request, num_scheduled.get(rid))
                if span is not None and self._reserve_group_store(
                    rid, request, *span, scheduler_output, chunks, pins
                ):
                    store_reqs.append(rid)
        else:
            self._reserve_stores(check, num_scheduled, scheduler_output, chunks, store_reqs)
        if chunks:  # one job for the step: one submission, one batch of copies
            job = TransferJob(next(self._job_ids), True, chunks)
            if pins:
                assert self.kvm is not None
                self.kvm.pin_blocks(pins)
            self._jobs[job.job_id] = JobRecord(job, "", store_reqs=store_reqs, pinned=pins)
            self._store_chunks_pending += len(chunks)
            for rid in store_reqs:
                self._reqs[rid].store_jobs.add(job.job_id)
            meta.stores.append(job)
        return meta

    def _check_at(self, rid: str, st: RequestState, step: int) -> None:
        st.due = step
        self._due.setdefault(step, []).append(rid)

    def _store_span(self, rid: str, request: Request, n_new: int | None) -> tuple[int, int] | None:
        """The chunks ``first .. end - 1`` that ``request`` completes this step (``n_new``
        tokens scheduled, None: not scheduled) and that are to be stored (None: none; chunks
        past the pending-store bound are dropped, counted); set when to look at the request
        again."""
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = RequestState(request)
        if st.finished:
            return None
        step = self._step
        if st.load_job is not None:  # its tokens are being loaded: look again next step
            self._check_at(rid, st, step + 1)
            return None
        ct = self.chunk_tokens
        # Tokens whose KV is valid once this step's forward ran.
        done = request.num_computed_tokens + (n_new or 0)
        n_full = min(done // ct, len(request.block_hashes) // self.blocks_per_chunk)
        first = st.next_store_chunk
        span = None
        if n_new and n_full > first:
            st.next_store_chunk = n_full
            if self._store_chunks_pending > self.max_pending_store_chunks:
                self._counts["dropped_store_chunks"] += n_full - first  # earlier stores lag
            else:
                span = first, n_full
        # The next chunk fills after ``next_boundary - done`` more tokens: at one token per
        # step (a decode), that many steps from now; sooner only by computing more than one
        # token in a step, which build_connector_meta catches on its own.
        self._check_at(rid, st, step + max(1, (st.next_store_chunk + 1) * ct - done))
        return span

    def _reserve_stores(
        self,
        check: dict[str, Request],
        num_scheduled: dict[str, int],
        scheduler_output: SchedulerOutput,
        chunks: WholeChunks,
        store_reqs: list[str],
    ) -> None:
        """Reserve tier slots for the chunks that the requests in ``check`` complete this step,
        all in one call to the manager (keys already held or being stored are skipped), and
        add their copies to ``chunks`` and their requests to ``store_reqs``. Per request, a few
        slices; no Python per chunk here but the manager's bookkeeping."""
        k = self.blocks_per_chunk
        keys: list[bytes] = []
        spans: list[tuple[str, Request, int, int]] = []
        for rid, request in check.items():
            span = self._store_span(rid, request, num_scheduled.get(rid))
            if span is not None:
                first, end = span
                spans.append((rid, request, first, end))
                keys += self._chunk_keys(request, first, end)
        if not keys:
            return
        metas = (
            [self._chunk_meta(r, i) for _, r, first, end in spans for i in range(first, end)]
            if self.emit_events
            else None
        )
        mgr = self._mgr()
        out = mgr.prepare_store(keys, metas)
        block_ids = scheduler_output.block_ids
        if out is not None and len(out.keys_to_store) == len(keys):  # the usual case
            chunks.slots += out.slots
            chunks.keys += keys
            ids = chunks.block_ids
            for rid, _, first, end in spans:
                ids += block_ids[rid][first * k : end * k]
                store_reqs.append(rid)
            return
        # Some keys held already, repeated, or no room: map the reserved keys back to their
        # requests (a key twice in this step: its first request's blocks).
        owner: dict[bytes, tuple[int, int, int]] = {}  # key -> (span, chunk, index in keys)
        j = 0
        for s, (_, _, first, end) in enumerate(spans):
            for i in range(first, end):
                owner.setdefault(keys[j], (s, i, j))
                j += 1
        used = [False] * len(spans)
        if out is not None:
            for key, slot in zip(out.keys_to_store, out.slots, strict=True):
                s, i, _ = owner[key]
                chunks.add(slot, key, block_ids[spans[s][0]][i * k : i * k + k])
                used[s] = True
        if self.storage is not None:  # no room in the host tier: on to storage anyway
            for key, (s, i, j) in owner.items():
                if mgr.slot_of(key) is None and key not in self._spills:
                    n = len(chunks)
                    meta = metas[j] if metas is not None else None
                    self._spill(key, meta, block_ids[spans[s][0]][i * k : i * k + k], chunks)
                    used[s] = used[s] or len(chunks) > n
        store_reqs += [span[0] for span, u in zip(spans, used, strict=True) if u]

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        rid = request.request_id
        self._forget_lookup(rid)
        st = self._reqs.get(rid)
        if st is None:
            return False
        rec = self._jobs.get(st.load_job) if st.load_job is not None else None
        if rec is not None and rec.staged_keys:
            # Aborted while storage chunks are staged into host slots (the request's own
            # blocks are not written yet): release at once, finish the staging on its own.
            pending = next((r for r in self._reads_to_start if r[0] == st.load_job), None)
            if pending is not None:
                self._reads_to_start.remove(pending)
                del self._jobs[st.load_job]
                mgr = self._mgr()
                mgr.complete_store(rec.staged_keys, success=False)
                mgr.complete_load([c.key for c in rec.job.chunks[: rec.staged_from]])
            else:
                rec.cancelled = True
            st.load_job = None
        job = next((j for j in self._loads_to_start if j.job_id == st.load_job), None)
        if job is not None:  # aborted before its load was handed to the worker
            self._loads_to_start.remove(job)
            del self._jobs[job.job_id]
            self._mgr().complete_load([c.key for c in job.chunks])
            st.load_job = None
        if st.load_job is None and not st.store_jobs:
            del self._reqs[rid]
            return False
        st.finished = True
        if st.load_job is not None and self.worker is not None:
            self.worker.cancel([st.load_job])  # aborted while loading: skip if not started
        return True
