"""The offloading connector: the primary pool's KV blocks also live in a host-memory tier.

Registered as ``"offload"`` (selected automatically when ``kv_offload_size > 0``).

Scheduler side (decisions; owns the :class:`OffloadingManager`):
- lookup: after the primary-pool prefix hit, the request's following chunks that the tier
  holds (a chunk is ``kv_offload_block_size`` tokens = ``k`` engine blocks, keyed by the hash
  of its last block). When the primary hit ends inside a chunk, only that chunk's blocks past
  the hit are loaded. At most ``num_tokens - 1`` tokens are claimed. Loads are always
  asynchronous: the request waits in WAITING_FOR_REMOTE_KVS while others compute.
- stores: each step, chunks that the step's forward completes are reserved in the tier
  (``prepare_store``) and copied after sampling (``wait_for_save``), never delaying tokens.
- a request has one load job or several store jobs in flight, never both; a finished request
  whose jobs are in flight keeps its blocks until they end (reported in ``finished_sending``).

Worker side (transfers; owns the host tier and the transfer worker): starts loads before the
forward, stores after sampling, flushes the stores of preempted requests before their blocks
are reused, and reports finished jobs. A chunk that fails verification on load is dropped from
the tier and its blocks (and the following ones of that load) are reported in
``invalid_block_ids``: the request recomputes them, the output never changes.

Both halves run in the engine's process and share this object; job completions are applied
to the manager in :meth:`get_finished` (the engine calls it every step). Before that, a step
that computed nothing (only transfers in flight) calls :meth:`wait_for_transfers`, which sleeps
on the transfer worker until a job ends: an engine that spins instead holds the GIL and starves
the transfer thread.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.config import GiB
from kvserve.engine.hashing import block_extra_keys, hash_to_int
from kvserve.kv.backends import create_backend
from kvserve.kv.backends.base import ChunkLayout, model_fingerprint
from kvserve.kv.connector import (
    KVConnectorBase,
    KVConnectorOutput,
    KVConnectorStats,
    register_connector,
)
from kvserve.kv.offload.manager import ChunkMeta, LoadSpec, LookupState, OffloadingManager
from kvserve.kv.offload.policies import create_policy
from kvserve.kv.offload.worker import ChunkCopy, TransferJob, TransferWorker, make_transfer_worker

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.engine.outputs import SchedulerOutput
    from kvserve.engine.request import Request
    from kvserve.kv.events import AnyKVEvent

logger = logging.getLogger(__name__)


@dataclass
class OffloadConnectorMetadata:
    """One step's instructions, scheduler side -> worker side."""

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)


@dataclass
class _RequestState:
    request: Request
    next_store_chunk: int = 0  # chunks below were stored, already held, or rejected
    load_job: int | None = None
    store_jobs: set[int] = field(default_factory=set)
    finished: bool = False  # request_finished() was called; waiting for jobs to end


@dataclass
class _JobRecord:
    job: TransferJob
    req_id: str
    missing_blocks: list[int] = field(default_factory=list)  # load blocks found gone at alloc


@dataclass
class _Lookup:
    num_computed_tokens: int
    num_external_tokens: int


@register_connector("offload")
class OffloadingConnector(KVConnectorBase):
    """Asynchronous offloading of KV chunks to a host-memory tier."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.kv_offload_size <= 0:
            raise ValueError("the offload connector needs kv_offload_size > 0 (GiB)")
        self.block_size = config.block_size
        chunk_tokens = config.kv_offload_block_size or config.block_size
        if chunk_tokens <= 0 or chunk_tokens % config.block_size:
            raise ValueError("kv_offload_block_size must be a positive multiple of block_size")
        self.blocks_per_chunk = chunk_tokens // config.block_size
        self.chunk_tokens = chunk_tokens
        self.size_bytes = int(config.kv_offload_size * GiB)
        self.policy_name = config.kv_offload_policy
        create_policy(self.policy_name, 1)  # fail fast on a bad name
        self.emit_events = bool(config.kv_events_endpoint) or bool(
            getattr(config, "enable_kv_cache_events", False)
        )
        self.manager: OffloadingManager | None = None
        self.worker: TransferWorker | None = None
        self._reqs: dict[str, _RequestState] = {}
        self._jobs: dict[int, _JobRecord] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._loads_to_start: list[TransferJob] = []
        self._job_ids = itertools.count(1)
        self._stats = KVConnectorStats()
        self._counts = {"load_jobs": 0, "store_jobs": 0, "loaded_chunks": 0, "invalid_chunks": 0}

    # ================================ worker side: setup =================================
    def register_kv_caches(self, kv_caches: torch.Tensor) -> None:
        """Allocate the host tier for this ``kv_cache`` layout and start the transfer worker."""
        layout = ChunkLayout.from_kv_cache(kv_caches, self.blocks_per_chunk)
        fingerprint = model_fingerprint(
            Path(self.config.model).name if self.config.model else "",
            self.config.prefix_hash_seed,
            layout.describe(),
        )
        tier = create_backend("cpu", layout, self.size_bytes, model=fingerprint)
        self.tier = tier
        self.manager = OffloadingManager(
            tier, self.policy_name, block_size=self.block_size, emit_events=self.emit_events
        )
        self.worker = make_transfer_worker(kv_caches, tier)
        logger.info(
            "KV offload tier: %d chunks x %d tokens (%.1f MiB host memory%s, policy %s)",
            tier.num_slots, self.chunk_tokens, tier.nbytes / (1 << 20),
            ", pinned" if tier.pinned else "", self.policy_name,
        )  # fmt: skip

    def _mgr(self) -> OffloadingManager:
        if self.manager is None:
            raise RuntimeError("register_kv_caches() must be called before using the connector")
        return self.manager

    def _chunk_keys(self, request: Request, first: int, end: int) -> list[bytes]:
        k = self.blocks_per_chunk
        hashes = request.block_hashes
        return [hashes[(i + 1) * k - 1] for i in range(first, end)]

    # ================================ scheduler side =====================================
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
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
        hits = self._mgr().lookup(self._chunk_keys(request, first, n_chunks))
        end = min((first + hits) * self.chunk_tokens, request.num_tokens - 1)
        num_external = end - num_computed_tokens
        if num_external < bs:  # less than a block: recomputing beats a round trip
            return 0, False
        self._lookups[rid] = _Lookup(num_computed_tokens, num_external)
        return num_external, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        lookup = self._lookups.pop(rid, None)
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _RequestState(request)
        st.request, st.next_store_chunk, st.finished = request, 0, False
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
        keys = self._chunk_keys(request, first, last + 1)
        mgr = self._mgr()
        hits = mgr.lookup(keys)  # cannot shrink within one schedule(); guard anyway
        spec = mgr.prepare_load(keys[:hits]) if hits else LoadSpec([])
        chunks: list[ChunkCopy] = []
        missing: list[int] = []
        for j, i in enumerate(range(first, last + 1)):
            b0, b1 = max(start_block, i * k), min(end_block, (i + 1) * k)
            if j < hits:
                chunks.append(ChunkCopy(spec.slots[j], keys[j], block_ids[b0:b1], b0 - i * k))
            else:
                missing.extend(block_ids[b0:b1])
        job = TransferJob(next(self._job_ids), is_store=False, chunks=chunks)
        self._jobs[job.job_id] = _JobRecord(job, rid, missing)
        self._loads_to_start.append(job)
        st.load_job = job.job_id

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadConnectorMetadata:
        meta = OffloadConnectorMetadata(loads=self._loads_to_start)
        self._loads_to_start = []
        mgr = self._mgr()
        k, ct = self.blocks_per_chunk, self.chunk_tokens
        for request in scheduler_output.scheduled:
            rid = request.request_id
            st = self._reqs.get(rid)
            if st is None:
                st = self._reqs[rid] = _RequestState(request)
            if st.load_job is not None:
                continue
            # Tokens whose KV is valid once this step's forward ran.
            done = request.num_computed_tokens + scheduler_output.num_scheduled_tokens[rid]
            n_full = min(done // ct, len(request.block_hashes) // k)
            if n_full <= st.next_store_chunk:
                continue
            first, st.next_store_chunk = st.next_store_chunk, n_full
            keys = self._chunk_keys(request, first, n_full)
            new = [
                (first + j, key) for j, key in enumerate(keys) if mgr.state(key) is LookupState.MISS
            ]
            if not new:
                continue
            metas = [self._chunk_meta(request, i) for i, _ in new] if self.emit_events else None
            out = mgr.prepare_store([key for _, key in new], metas)
            if out is None or not out.keys_to_store:
                continue
            index = {key: i for i, key in new}
            block_ids = scheduler_output.block_ids[rid]
            chunks = [
                ChunkCopy(slot, key, block_ids[index[key] * k : (index[key] + 1) * k])
                for key, slot in zip(out.keys_to_store, out.slots, strict=True)
            ]
            job = TransferJob(next(self._job_ids), is_store=True, chunks=chunks)
            self._jobs[job.job_id] = _JobRecord(job, rid)
            st.store_jobs.add(job.job_id)
            meta.stores.append(job)
        return meta

    def _chunk_meta(self, request: Request, i: int) -> ChunkMeta:
        k, bs = self.blocks_per_chunk, self.block_size
        b0 = i * k
        hashes = request.block_hashes
        extra = [
            block_extra_keys(b, request.cache_salt, request.lora_name) for b in range(b0, b0 + k)
        ]
        return ChunkMeta(
            block_hashes=[hash_to_int(h) for h in hashes[b0 : b0 + k]],
            parent_block_hash=hash_to_int(hashes[b0 - 1]) if b0 else None,
            token_ids=list(request.all_token_ids[b0 * bs : (b0 + k) * bs]),
            extra_keys=extra if any(e is not None for e in extra) else None,
            lora_name=request.lora_name,
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        rid = request.request_id
        self._lookups.pop(rid, None)
        st = self._reqs.get(rid)
        if st is None:
            return False
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

    def touch(self, block_hashes: list[bytes]) -> None:
        k = self.blocks_per_chunk
        if self.manager is not None:
            self.manager.touch(block_hashes[k - 1 :: k])

    def take_events(self) -> list[AnyKVEvent]:
        return self.manager.take_events() if self.manager is not None else []

    def stats(self) -> KVConnectorStats:
        s = self._stats
        out = KVConnectorStats(
            lookups=s.lookups,
            lookup_hit_tokens=s.lookup_hit_tokens,
            lookup_query_tokens=s.lookup_query_tokens,
            load_bytes=s.load_bytes,
            load_time_s=s.load_time_s,
            store_bytes=s.store_bytes,
            store_time_s=s.store_time_s,
        )
        mgr = self.manager
        if mgr is not None:
            ms = mgr.stats
            out.allocation_failures = ms.allocation_failures
            out.extra = {
                "tier_usage": mgr.usage,
                "tier_chunks": float(mgr.num_chunks),
                "tier_capacity_chunks": float(mgr.capacity),
                "tier_capacity_bytes": float(self.tier.nbytes),
                "stored_chunks": float(ms.stored),
                "evicted_chunks": float(ms.evicted),
                "rejected_chunks": float(ms.rejected),
                "failed_store_chunks": float(ms.store_failed),
                **{k: float(v) for k, v in self._counts.items()},
            }
        return out

    # ================================ worker side: per step ==============================
    def start_load_kv(self, metadata: OffloadConnectorMetadata | None) -> None:
        if metadata is None or self.worker is None:
            return
        for job in metadata.loads:
            if job.job_id in self._jobs:  # not cancelled by an abort since scheduling
                self.worker.submit(job)

    def wait_for_save(self, metadata: OffloadConnectorMetadata | None) -> None:
        if metadata is None or self.worker is None:
            return
        for job in metadata.stores:
            self.worker.submit(job)

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        """Preempted requests' blocks are reused by this step's forward: finish their stores."""
        if not preempted_req_ids or self.worker is None:
            return
        jobs = [
            j for rid in preempted_req_ids if (st := self._reqs.get(rid)) for j in st.store_jobs
        ]
        if jobs:
            self.worker.wait(jobs)

    def wait_for_transfers(self, timeout: float) -> bool:
        if self.worker is None or not self._jobs:
            return False
        self.worker.wait_any(timeout)
        return True

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        if self.worker is None:
            return out
        mgr = self._mgr()
        for res in self.worker.poll():
            rec = self._jobs.pop(res.job_id, None)
            if rec is None:
                continue
            job, rid = rec.job, rec.req_id
            st = self._reqs.get(rid)
            keys = [c.key for c in job.chunks]
            if job.is_store:
                mgr.complete_store(keys, success=res.ok)
                self._stats.store_bytes += res.nbytes
                self._stats.store_time_s += res.seconds
                self._counts["store_jobs"] += 1
                if st is not None:
                    st.store_jobs.discard(job.job_id)
            else:
                mgr.complete_load(keys)
                self._stats.load_bytes += res.nbytes
                self._stats.load_time_s += res.seconds
                self._counts["load_jobs"] += 1
                self._counts["loaded_chunks"] += len(keys) - len(res.bad_chunks)
                invalid = list(rec.missing_blocks)
                if res.bad_chunks and not res.cancelled:
                    self._counts["invalid_chunks"] += len(res.bad_chunks)
                    mgr.remove([keys[i] for i in res.bad_chunks])
                    first_bad = min(res.bad_chunks)
                    logger.warning(
                        "request %s: %d offloaded chunk(s) failed verification; recomputing",
                        rid, len(res.bad_chunks),
                    )  # fmt: skip
                    invalid.extend(b for c in job.chunks[first_bad:] for b in c.block_ids)
                if st is not None:
                    st.load_job = None
                    if not st.finished:
                        out.finished_recving.add(rid)
                        out.invalid_block_ids.update(invalid)
            if st is not None and st.finished and st.load_job is None and not st.store_jobs:
                out.finished_sending.add(rid)
                del self._reqs[rid]
        return out

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
        if self.manager is not None:
            self.tier.close()
