"""The offloading connector: the primary pool's KV blocks also live in a host-memory tier,
and, below it, in storage tiers (local disk, a shared file system, Redis/Valkey).

Registered as ``"offload"`` (selected automatically when ``kv_offload_size > 0``).
:class:`OffloadingConnector` owns the connector's state (set up in ``__init__``), the host tier
and the transfer worker (``register_kv_caches``), chunk keys and events metadata, stats; its
behaviour comes in parts, one concept per module, each a mixin of methods on that state. It
stays one object: unlike vLLM's scheduler and worker connectors, which live in different
processes and talk only through metadata and ``KVConnectorOutput``, both halves run in the
engine's process, and job completions (worker side) update the manager and the requests'
states (scheduler side) directly.

- :mod:`.scheduler_side`: lookups, loads after allocation, store planning, request ends;
- :mod:`.worker_side`: per-step transfers (loads before the forward, stores after sampling),
  preemptions, waiting for transfers, completions applied to the manager;
- :mod:`.group_stage`: KV cache groups (hybrid models): hits, staging, loads and stores per
  group;
- :mod:`.storage_tiers`: the storage tiers below the host tier (the host tier is the gateway):
  lookups, staging hits into host slots, the write cascade, spills, tier KV events;
- :mod:`.connector_state`: the per-step metadata and the per-request and per-job records.

A chunk is ``kv_offload_block_size`` tokens (``blocks_per_chunk`` engine blocks), keyed by the
hash of its last block (:meth:`OffloadingConnector._chunk_keys`). Loads are asynchronous and a
chunk that fails verification (host or storage) is recomputed (``invalid_block_ids``): the
output never changes.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import TYPE_CHECKING

from kvserve.config import GiB
from kvserve.engine.hashing import block_extra_keys, hash_to_int
from kvserve.kv.backends import create_backend
from kvserve.kv.backends.base import ChunkLayout
from kvserve.kv.backends.chunk_format import (
    ChunkCodec,
    fingerprint_model_dir,
    group_chunk_key,
    kv_groups_identity,
)
from kvserve.kv.backends.storage import StorageBackend, load_tier_specs
from kvserve.kv.connector import KVConnectorBase, KVConnectorStats, register_connector
from kvserve.kv.offload.connector_state import (
    JobRecord,
    LookupResult,
    OffloadConnectorMetadata,
    RequestState,
    TierLookup,
)
from kvserve.kv.offload.group_stage import GroupOffloading, GroupStage
from kvserve.kv.offload.manager import ChunkMeta, OffloadingManager
from kvserve.kv.offload.policies import create_policy
from kvserve.kv.offload.scheduler_side import SchedulerSide
from kvserve.kv.offload.storage_tiers import MAX_SPILL_SLOTS, WRITE_RETRY_DELAY_S, StorageTiers
from kvserve.kv.offload.storage_worker import ReadItem, StorageWorker
from kvserve.kv.offload.worker import TransferJob, TransferWorker, make_transfer_worker
from kvserve.kv.offload.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.engine.kv_cache_manager import KVCacheManager
    from kvserve.engine.request import Request
    from kvserve.kv.events import AnyKVEvent

__all__ = [
    "MAX_SPILL_SLOTS",
    "WRITE_RETRY_DELAY_S",
    "OffloadConnectorMetadata",
    "OffloadingConnector",
]

logger = logging.getLogger(__name__)


@register_connector("offload")
class OffloadingConnector(
    SchedulerSide, WorkerSide, GroupOffloading, StorageTiers, KVConnectorBase
):
    """Asynchronous offloading of KV chunks to a host-memory tier and the storage tiers below."""

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
        self._reqs: dict[str, RequestState] = {}
        self._jobs: dict[int, JobRecord] = {}
        self._lookups: dict[str, LookupResult] = {}
        self._loads_to_start: list[TransferJob] = []
        self._job_ids = itertools.count(1)
        # Store planning without a pass over every running request: build_connector_meta
        # counts steps, and each request waits in ``_due[step]`` for the step its next chunk
        # can fill at one token per step (entries whose request moved on are skipped).
        self._step = 0
        self._due: dict[int, list[str]] = {}
        # The metadata of a step with nothing to load, stage or store (without, with a forward
        # pass): shared, never changed.
        self._quiet_meta = (
            OffloadConnectorMetadata(forward=False),
            OffloadConnectorMetadata(forward=True),
        )
        # Store chunks submitted and not completed (stores may lag: see the worker), and the
        # most allowed: beyond it later steps' chunks are not stored (counted), since every
        # lagging store holds primary-pool blocks of its (maybe finished) request.
        self._store_chunks_pending = 0
        self.max_pending_store_chunks = 0  # set with the primary pool, in register_kv_caches
        self._stats = KVConnectorStats()
        self._counts = {
            "load_jobs": 0, "store_jobs": 0, "loaded_chunks": 0, "invalid_chunks": 0,
            "tier_loaded_chunks": 0, "tier_failed_chunks": 0, "tier_lookup_timeouts": 0,
            "dropped_store_chunks": 0, "tier_staging_timeouts": 0,
            "tier_write_retried_chunks": 0, "tier_write_failed_chunks": 0,
            "tier_spilled_chunks": 0, "tier_spill_dropped_chunks": 0,
        }  # fmt: skip
        # Storage tiers below the host tier (created with it, in register_kv_caches).
        self.tier_specs = load_tier_specs(config.kv_tier, config.kv_tiers_config)
        self.tiers: list[StorageBackend] = []
        self.storage: StorageWorker | None = None
        self.lookup_timeout = config.kv_tier_lookup_timeout
        self._tier_lookups: dict[str, TierLookup] = {}
        # Requests whose storage hits wait for host slots to stage into (since when).
        self._room_waits: dict[str, float] = {}
        self._lookup_in_memory = False  # every tier answers lookups without I/O
        self._lookup_ops: dict[int, str] = {}  # lookup op -> request id
        self._read_ops: dict[int, int] = {}  # read op -> load job id
        # write op -> (host chunks it pins, attempt: 0 first, 1 the retry)
        self._write_ops: dict[int, tuple[list[bytes], int]] = {}
        # Chunks that reached no storage tier, still pinned, retried once at the given time.
        self._write_retries: deque[tuple[float, list[bytes]]] = deque()
        self.write_retry_delay_s = WRITE_RETRY_DELAY_S
        # Spill slots (host memory outside the host tier's allocation) free, in use by key
        # (slot, event metadata), and spill writes in flight (op -> keys).
        self._spill_free: list[int] = []
        self._spills: dict[bytes, tuple[int, ChunkMeta | None]] = {}
        self._spill_ops: dict[int, list[bytes]] = {}
        self._reads_to_start: list[tuple[int, list[ReadItem]]] = []
        self._events: list[AnyKVEvent] = []
        # Block hashes of chunks in private storage tiers (for BlockRemoved on eviction).
        # (with the chunk's KV cache group)
        self._tier_blocks: list[dict[bytes, tuple[list[int], int]]] = []
        self._pause_writes = False  # kv_tier_write_pause (set with the storage worker)
        # KV cache groups (bind_kv_cache_manager): the window of each (None: full attention).
        self.kvm: KVCacheManager | None = None
        self.group_windows: list[int | None] = [None]
        self.per_group = False  # several groups, or a sliding one: the per-group paths
        # Storage-tier hits of waiting requests staged per group (request -> stage), and the
        # storage operations (lookups, reads) of the stages (op -> stage).
        self._group_stages: dict[str, GroupStage] = {}
        self._stage_ops: dict[int, GroupStage] = {}

    def bind_kv_cache_manager(self, kvm: KVCacheManager) -> None:
        """The engine's KV cache manager: its groups (stores and loads per group), its block
        tables, pins on the sliding-window blocks a store reads."""
        self.kvm = kvm
        self.group_windows = [g.spec.sliding_window for g in kvm.kv_cache_groups]
        self.per_group = len(self.group_windows) > 1 or self.group_windows[0] is not None
        if self.per_group:
            kvm.set_sliding_hold(self.chunk_tokens)

    # ================================ worker side: setup =================================
    def register_kv_caches(self, kv_caches: torch.Tensor) -> None:
        """Allocate the host tier for this ``kv_cache`` layout and start the transfer worker."""
        layout = ChunkLayout.from_kv_cache(kv_caches, self.blocks_per_chunk)
        # Names the weights (sampled content), the hash seed and the layout: instances share
        # stored KV only when they would compute the same KV.
        # With KV cache groups, also the grouping (a block holds one group's layers).
        groups = []
        if self.per_group and self.kvm is not None:
            groups = [kv_groups_identity(self.kvm.kv_cache_groups)]
        fingerprint = fingerprint_model_dir(
            self.config.model or "", self.config.prefix_hash_seed, layout.describe(), *groups
        )
        # With storage tiers, a few slots are kept out of the host tier's allocation: a chunk
        # the host tier has no room for is copied there, written to the storage tiers, freed.
        total = self.size_bytes // layout.chunk_bytes
        spare = max(1, min(MAX_SPILL_SLOTS, total // 8)) if self.tier_specs and total > 1 else 0
        # With a writer process, the host tier lives in shared memory: it reads chunks in place.
        write_process = bool(self.tier_specs) and self.config.kv_tier_write_process
        tier = create_backend(
            "cpu", layout, self.size_bytes, model=fingerprint, spare_slots=spare,
            shared=write_process,
        )  # fmt: skip
        self.tier = tier
        self._spill_free = list(range(tier.num_slots, tier.num_slots + spare))
        self.manager = OffloadingManager(
            tier, self.policy_name, block_size=self.block_size, emit_events=self.emit_events
        )
        self.worker = make_transfer_worker(kv_caches, tier)
        self.max_pending_store_chunks = max(1, kv_caches.shape[0] // (2 * self.blocks_per_chunk))
        # Stores stop waiting for gaps between forward passes well before that bound.
        self.worker.store_max_pending_blocks = kv_caches.shape[0] // 4
        if self.tier_specs:
            codec = ChunkCodec(fingerprint, layout.describe(), layout.chunk_bytes)
            self.tiers = [
                create_backend(spec.type, codec, **spec.options) for spec in self.tier_specs
            ]
            self._tier_blocks = [{} for _ in self.tiers]
            self._lookup_in_memory = all(t.lookup_in_memory for t in self.tiers)
            cfg = self.config
            self.storage = StorageWorker(
                self.tiers,
                io_threads=cfg.kv_tier_io_threads,
                max_pending_writes=cfg.kv_tier_max_pending_writes,
                write_threads=cfg.kv_tier_write_threads,
                write_batch=cfg.kv_tier_write_batch,
                write_duty=cfg.kv_tier_write_duty,
                writer_policy=cfg.kv_tier_write_policy,
                write_process=write_process,
                host=tier,
                specs=self.tier_specs,
            )
            self._pause_writes = cfg.kv_tier_write_pause
            for spec, t in zip(self.tier_specs, self.tiers, strict=True):
                logger.info("KV storage tier %s (%s, %s)", spec.describe(), t.locality,
                            "shared" if t.shared else "private")  # fmt: skip
        logger.info(
            "KV offload tier: %d chunks x %d tokens (%.1f MiB host memory%s, policy %s)",
            tier.num_slots, self.chunk_tokens, tier.nbytes / (1 << 20),
            ", pinned" if tier.pinned else "", self.policy_name,
        )  # fmt: skip

    def shutdown(self) -> None:
        if self.storage is not None:
            self.storage.shutdown()
            self.storage = None
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
        if self.manager is not None:
            self.tier.close()

    # ================================ shared helpers =====================================
    def _mgr(self) -> OffloadingManager:
        if self.manager is None:
            raise RuntimeError("register_kv_caches() must be called before using the connector")
        return self.manager

    def _chunk_keys(self, request: Request, first: int, end: int, group: int = 0) -> list[bytes]:
        k = self.blocks_per_chunk
        keys = request.block_hashes[(first + 1) * k - 1 : end * k : k]
        return [group_chunk_key(key, group) for key in keys] if group else keys

    def _chunk_meta(self, request: Request, i: int, group: int = 0) -> ChunkMeta:
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
            group_idx=group,
            kv_cache_spec_kind="sliding_window" if self.group_windows[group] else "full_attention",
            kv_cache_spec_sliding_window=self.group_windows[group],
        )

    # ================================ events, stats, touch ===============================
    def touch(self, block_hashes: list[bytes]) -> None:
        k = self.blocks_per_chunk
        if self.manager is None:
            return
        keys = block_hashes[k - 1 :: k]
        self.manager.touch(keys)
        for g, window in enumerate(self.group_windows):
            if g and keys:  # every group's chunks, a sliding group's only within its window
                n = len(keys) if window is None else -(-window // self.chunk_tokens) + 1
                self.manager.touch([group_chunk_key(key, g) for key in keys[-n:]])

    def take_events(self) -> list[AnyKVEvent]:
        if self.manager is None:
            return []
        if self.tiers:
            self._collect_tier_evictions()
        events = self.manager.take_events()
        if self._events:
            events.extend(self._events)
            self._events = []
        return events

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
            w = self.worker
            if w is not None and hasattr(w, "store_cpu_s"):
                out.extra["store_cpu_s"] = w.store_cpu_s
                out.extra["store_cpu_in_forward_s"] = w.store_cpu_in_forward_s
        for tier in self.tiers:
            used, cap = tier.usage()
            row = tier.stats.as_dict()
            row.update(usage_bytes=float(used), capacity_bytes=float(cap))
            out.tiers[tier.tier_id] = row
        return out
