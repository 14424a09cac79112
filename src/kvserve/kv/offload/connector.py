"""The offloading connector: the primary pool's KV blocks also live in a host-memory tier,
and, below it, in storage tiers (local disk, a shared file system, Redis/Valkey).

Registered as ``"offload"`` (selected automatically when ``kv_offload_size > 0``).

Storage tiers (``kv_tier`` / ``kv_tiers_config``) sit behind the host tier, which stays the
gateway (as in vLLM's multi-tier offloading): every chunk stored in host memory is cascaded to
every storage tier by the :class:`StorageWorker` (asynchronous, bounded: a write that finds the
queue full is dropped and counted); a lookup asks the host tier, then the storage tiers for the
chunks after its hits (asynchronously: the scheduler is told to ask again while the lookup runs,
and a lookup slower than ``kv_tier_lookup_timeout`` is a miss); a storage hit is staged into
host-tier slots (reserved like a store, verified by the tier with a full-content hash) and then
loaded like any host hit, so it stays in host memory for the next request. A failed or partial
read is recomputed (``invalid_block_ids``), exactly like a host chunk that fails verification.

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

KV cache groups (hybrid models, :mod:`kvserve.engine.kv_cache_spec`): every group stores its
own chunks (keys :func:`~kvserve.kv.backends.chunk_format.group_chunk_key`, events with the
group); a lookup hits where the full-attention groups hold every chunk and each sliding-window
group the chunks covering the window before the hit point, and a load reads only those for a
sliding group (its blocks before the window are the null block). A sliding group's blocks
are freed by the window only in whole chunks, once the chunk is complete and its store planned;
a store pins the sliding blocks it reads until it ends. Storage tiers hold every group's
chunks too (the cascade writes each under its group's key); a storage hit is staged into host
slots before the request is allocated (:class:`_GroupStage`: lookups per group, then one read
of only the chunks the hit needs, a sliding group's window), so a chunk that fails to read is a
shorter hit. With P/D (whole blocks of every layer) a hybrid model keeps one group.

Both halves run in the engine's process and share this object; job completions are applied
to the manager in :meth:`get_finished` (the engine calls it every step). Before that, a step
that computed nothing (only transfers in flight) calls :meth:`wait_for_transfers`, which sleeps
on the transfer worker until a job ends: an engine that spins instead holds the GIL and starves
the transfer thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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
from kvserve.kv.connector import (
    KVConnectorBase,
    KVConnectorOutput,
    KVConnectorStats,
    register_connector,
)
from kvserve.kv.events import BlockRemoved, BlockStored
from kvserve.kv.offload.manager import ChunkMeta, LoadSpec, OffloadingManager
from kvserve.kv.offload.policies import create_policy
from kvserve.kv.offload.storage_worker import ReadItem, StorageResult, StorageWorker
from kvserve.kv.offload.worker import ChunkCopy, TransferJob, TransferWorker, make_transfer_worker

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.engine.kv_cache_manager import KVCacheManager
    from kvserve.engine.outputs import SchedulerOutput
    from kvserve.engine.request import Request
    from kvserve.kv.events import AnyKVEvent

logger = logging.getLogger(__name__)

# A cascade write that reached no storage tier is retried once, this long after it ended.
WRITE_RETRY_DELAY_S = 1.0
# Most host slots kept for chunks on their way to the storage tiers that the host tier had
# no room for (an eighth of the host tier at most).
MAX_SPILL_SLOTS = 32


@dataclass
class OffloadConnectorMetadata:
    """One step's instructions, scheduler side -> worker side."""

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    # Storage-tier hits to stage into host-tier slots (job id -> reads); the job's copy to the
    # primary pool starts once they are in.
    reads: list[tuple[int, list[ReadItem]]] = field(default_factory=list)
    forward: bool = False  # the step computes tokens (a forward pass runs)


@dataclass
class _RequestState:
    request: Request
    next_store_chunk: int = 0  # chunks below were stored, already held, or rejected
    load_job: int | None = None
    store_jobs: set[int] = field(default_factory=set)
    finished: bool = False  # request_finished() was called; waiting for jobs to end
    # Step at which build_connector_meta next looks at this request: the step its next chunk
    # fills if it computes one token per step (requests computing more are found apart).
    due: int = 0


@dataclass
class _JobRecord:
    job: TransferJob
    req_id: str  # a load's request ("" for a store: see ``store_reqs``)
    missing_blocks: list[int] = field(default_factory=list)  # load blocks found gone at alloc
    # Storage-tier chunks of a load being staged into host slots: their keys and slots (the
    # job's chunks from index ``staged_from`` on); empty once the copy job was started.
    staged_keys: list[bytes] = field(default_factory=list)
    staged_from: int = 0
    cancelled: bool = False  # the request ended while its chunks were staged
    # A store job carries every chunk one step completes, of these requests.
    store_reqs: list[str] = field(default_factory=list)
    # Sliding-window blocks the store pins (released when it ends).
    pinned: list[int] = field(default_factory=list)


@dataclass
class _Lookup:
    num_computed_tokens: int
    num_external_tokens: int
    tier_sources: list[int] = field(default_factory=list)  # storage tier of each chunk past
    cpu_chunks: int = 0  # the host tier's hits (chunks), which come first


@dataclass
class _TierLookup:
    """A storage-tier lookup of a waiting request's chunks from chunk ``first`` on."""

    op_id: int
    first: int
    started: float
    sources: list[int] | None = None  # None while in flight


@dataclass
class _GroupStage:
    """Storage-tier hits of a waiting request of a model with KV cache groups, staged into
    host-tier slots before the request is allocated: lookups per group (group ``g`` from
    chunk ``starts[g]`` on), then one read of the chunks the hit needs. Once ``done``, the
    hit is the host tier's: a chunk that failed to read is simply not there (a shorter hit,
    never a rollback into blocks a window dropped)."""

    first: int
    started: float
    starts: list[int]
    sources: list[list[int] | None]  # per group: tier of each chunk from starts[g]; None: asked
    lookups: dict[int, list[int]] = field(default_factory=dict)  # op -> its groups, in flight
    keys: list[bytes] = field(default_factory=list)  # chunks being read into host slots
    slots: list[int] = field(default_factory=list)
    reading: bool = False
    room_since: float | None = None  # waiting for host slots to stage into, since
    end: int = 0  # the longest hit looked for: chunks first .. end - 1
    windows_checked: bool = False  # the sliding groups' lookups follow the full groups' run
    done: bool = False


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
        # Store planning without a pass over every running request: build_connector_meta
        # counts steps, and each request waits in ``_due[step]`` for the step its next chunk
        # can fill at one token per step (entries whose request moved on are skipped).
        self._step = 0
        self._due: dict[int, list[str]] = {}
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
        self._tier_lookups: dict[str, _TierLookup] = {}
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
        self._group_stages: dict[str, _GroupStage] = {}
        self._stage_ops: dict[int, _GroupStage] = {}

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

    def _mgr(self) -> OffloadingManager:
        if self.manager is None:
            raise RuntimeError("register_kv_caches() must be called before using the connector")
        return self.manager

    def _chunk_keys(self, request: Request, first: int, end: int, group: int = 0) -> list[bytes]:
        k = self.blocks_per_chunk
        hashes = request.block_hashes
        if group:
            return [group_chunk_key(hashes[(i + 1) * k - 1], group) for i in range(first, end)]
        return [hashes[(i + 1) * k - 1] for i in range(first, end)]

    def _group_hits(
        self, request: Request, first: int, end: int, stage: _GroupStage | None = None
    ) -> int:
        """Chunks from ``first`` every KV cache group can load: the full-attention groups'
        leading run, shortened until each sliding group holds the chunks covering its window
        before the hit point (``min(end * chunk_tokens, num_tokens - 1)``). With ``stage``,
        a chunk its storage-tier lookups found counts as held too."""
        mgr = self._mgr()
        ct = self.chunk_tokens

        def held(g: int, lo: int, hi: int) -> bool:
            keys = self._chunk_keys(request, lo, hi, g)
            n = mgr.lookup(keys)
            if stage is None or n == len(keys):
                return n == len(keys)
            start, src = stage.starts[g], stage.sources[g] or []
            return all(
                start <= lo + j < start + len(src) or mgr.lookup([key])
                for j, key in enumerate(keys[n:], n)
            )

        end = self._full_end(request, first, end, stage)
        while end > first:
            hit = min(end * ct, request.num_tokens - 1)
            if all(
                held(g, max(first, (hit - window + 1) // ct), -(-hit // ct))
                for g, window in enumerate(self.group_windows)
                if window is not None
            ):
                return end - first
            end -= 1
        return 0

    def _full_end(
        self, request: Request, first: int, end: int, stage: _GroupStage | None = None
    ) -> int:
        """End of the leading run of chunks from ``first`` every full-attention group holds
        (in the host tier or, with ``stage``, found below it)."""
        mgr = self._mgr()
        for g, window in enumerate(self.group_windows):
            if window is None and end > first:
                n = mgr.lookup(self._chunk_keys(request, first, end, g))
                if stage is not None and first + n >= stage.starts[g]:
                    n = max(n, stage.starts[g] + len(stage.sources[g] or []) - first)
                end = min(end, first + n)
        return end

    def _group_needs(self, request: Request, first: int, end: int) -> list[tuple[int, int, bytes]]:
        """``(chunk, group, key)`` of every chunk a hit of chunks ``first .. end - 1`` loads:
        a full-attention group's every chunk, a sliding group's those covering its window
        before the hit point; in chunk order."""
        ct = self.chunk_tokens
        hit = min(end * ct, request.num_tokens - 1)
        out: list[tuple[int, int, bytes]] = []
        for g, window in enumerate(self.group_windows):
            lo = first if window is None else max(first, (hit - window + 1) // ct)
            hi = -(-hit // ct)
            out.extend(
                (i, g, key)
                for i, key in zip(range(lo, hi), self._chunk_keys(request, lo, hi, g), strict=True)
            )
        out.sort(key=lambda t: (t[0], t[1]))
        return out

    def _stage_group_hits(self, rid: str, request: Request, first: int, n_usable: int) -> bool:
        """Stage the storage-tier chunks that extend ``request``'s host-tier hit into host
        slots, per KV cache group: lookups (full groups' chunks, sliding groups' window
        before the longest hit; again for the windows when the full groups' run is shorter),
        then one read of the chunks the longest hit needs that the host tier lacks (a sliding
        group's older chunks are never read, nor looked up). False while a lookup or read
        runs: ask again next step. Past ``kv_tier_lookup_timeout`` of lookup or of waiting
        for host room, no storage hit."""
        assert self.storage is not None
        stage = self._group_stages.get(rid)
        if stage is not None and stage.first != first:  # its primary hit changed
            self._drop_stage(rid)
            stage = None
        if stage is None:
            stage = self._start_group_stage(request, first, n_usable)
            self._group_stages[rid] = stage
        if stage.done:
            return True
        if stage.reading:
            return False
        now = time.monotonic()
        if stage.lookups:
            if now - stage.started < self.lookup_timeout:
                return False
            self._counts["tier_lookup_timeouts"] += 1
            for op in stage.lookups:
                self._stage_ops.pop(op, None)
            stage.lookups.clear()
            stage.done = True
            return True
        if not stage.windows_checked:  # the full groups' run is known now
            stage.windows_checked = True
            end = self._full_end(request, first, stage.end, stage)
            if end < stage.end:
                stage.end = end
                sliding = [g for g, w in enumerate(self.group_windows) if w is not None]
                if end > first and sliding:
                    self._stage_lookups(stage, request, sliding)
                    if stage.lookups:
                        return False
        mgr = self._mgr()
        hits = self._group_hits(request, first, stage.end, stage)
        want: list[tuple[int, bytes, int]] = []  # (chunk, key, tier)
        for i, g, key in self._group_needs(request, first, first + hits):
            if not mgr.lookup([key]):
                src = stage.sources[g] or []
                if not stage.starts[g] <= i < stage.starts[g] + len(src):
                    stage.done = True  # left the host tier since the lookup: host hits only
                    return True
                want.append((i, key, src[i - stage.starts[g]]))
        if not want:
            stage.done = True
            return True
        if mgr.num_reservable() < min(len(want), mgr.capacity):
            # Loads pin slots or stores fill them: those end soon.
            if stage.room_since is None:
                stage.room_since = now
            if now - stage.room_since < self.lookup_timeout:
                return False
            self._counts["tier_staging_timeouts"] += 1
            stage.done = True
            return True
        groups_of = {key: g for _, g, key in self._group_needs(request, first, first + hits)}
        metas = (
            [self._chunk_meta(request, i, groups_of[key]) for i, key, _ in want]
            if self.emit_events
            else None
        )
        out = mgr.prepare_store([key for _, key, _ in want], metas)
        tier_of = {key: t for _, key, t in want}
        slot_u8 = self.tier.slots_u8
        items = [
            ReadItem(tier_of[key], key, memoryview(slot_u8[slot].numpy()))
            for key, slot in zip(out.keys_to_store, out.slots, strict=True)
        ] if out is not None else []  # fmt: skip
        if not items:
            stage.done = True
            return True
        stage.keys, stage.slots, stage.reading = list(out.keys_to_store), list(out.slots), True
        self._stage_ops[self.storage.read(items)] = stage
        return False

    def _start_group_stage(self, request: Request, first: int, n_usable: int) -> _GroupStage:
        """A stage for a hit of chunks ``first .. n_usable - 1``, its lookups started."""
        num_groups = len(self.group_windows)
        stage = _GroupStage(
            first, time.monotonic(), [first] * num_groups, [[] for _ in range(num_groups)]
        )
        stage.end = n_usable
        self._stage_lookups(stage, request, range(num_groups))
        return stage

    def _stage_lookups(self, stage: _GroupStage, request: Request, groups: Iterable[int]) -> None:
        """Look ``groups``' chunks up below the host tier, for a hit of chunks up to
        ``stage.end``: a full group's from ``stage.first``, a sliding group's those covering
        its window before the hit point; each from the end of its host-tier run."""
        assert self.storage is not None
        mgr = self._mgr()
        ct, first = self.chunk_tokens, stage.first
        hit = min(stage.end * ct, request.num_tokens - 1)
        runs: dict[int, list[bytes]] = {}  # group -> keys to look up (one operation)
        for g in groups:
            window = self.group_windows[g]
            lo = first if window is None else max(first, (hit - window + 1) // ct)
            hi = stage.end if window is None else -(-hit // ct)
            keys = self._chunk_keys(request, lo, hi, g)
            n = mgr.lookup(keys)
            stage.starts[g] = lo + n
            rest = keys[n:]
            if not rest:
                stage.sources[g] = []
            elif self._lookup_in_memory:
                stage.sources[g] = self.storage.lookup_now(rest)
            else:
                stage.sources[g] = None
                runs[g] = rest
        if runs:
            op = self.storage.lookup_runs(list(runs.values()))
            stage.lookups[op] = list(runs)
            self._stage_ops[op] = stage

    def _drop_stage(self, rid: str) -> None:
        """Forget a request's stage; a read in flight still ends (its slots are settled)."""
        stage = self._group_stages.pop(rid, None)
        if stage is not None:
            for op in stage.lookups:
                self._stage_ops.pop(op, None)
            stage.lookups.clear()

    def _stage_read_done(self, stage: _GroupStage, res: StorageResult) -> None:
        """A stage's chunks are in host slots (or failed): the verified ones are host-tier
        chunks from now on, the others are dropped (a miss: a shorter hit)."""
        mgr = self._mgr()
        ok = list(res.ok) + [False] * (len(stage.keys) - len(res.ok))
        good = [k for k, g in zip(stage.keys, ok, strict=False) if g]
        bad = [k for k, g in zip(stage.keys, ok, strict=False) if not g]
        slots = [s for s, g in zip(stage.slots, ok, strict=False) if g]
        self._settle_staged(mgr, slots, good, bad, res, "")
        stage.keys, stage.slots, stage.reading, stage.done = [], [], False, True

    def _settle_staged(
        self,
        mgr: OffloadingManager,
        slots: list[int],
        good: list[bytes],
        bad: list[bytes],
        res: StorageResult,
        who: str,
    ) -> None:
        """Storage chunks staged into host slots: the verified ones (``good`` in ``slots``)
        become host-tier chunks, the others are dropped; counted either way."""
        if good:
            # The tier verified the payload (full hash); record the host header of what is
            # now in the slot, so a copy from it is verified like any host chunk.
            self.tier.record(slots, good)
        mgr.complete_store(good, success=True)
        mgr.complete_store(bad, success=False)
        self._counts["tier_loaded_chunks"] += len(good)
        self._counts["tier_failed_chunks"] += len(bad)
        self._stats.load_bytes += res.nbytes
        self._stats.load_time_s += res.seconds
        if bad:
            logger.warning(
                "%s%d storage-tier chunk(s) missing or failed verification; recomputing",
                who, len(bad),
            )  # fmt: skip

    # ================================ scheduler side =====================================
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
        self._lookups[rid] = _Lookup(num_computed_tokens, num_external, sources, hits)
        return num_external, True

    def _stageable(self, rid: str, sources: list[int]) -> list[int] | None:
        """The storage hits ``sources`` that host slots can be reserved for, to stage them
        in. None (ask again next step) while fewer are reservable only because loads pin
        slots or stores fill them: those end soon. Past ``kv_tier_lookup_timeout`` of
        waiting, the hits that fit."""
        mgr = self._mgr()
        need = min(len(sources), mgr.capacity)
        room = mgr.num_reservable()
        if room >= need:
            self._room_waits.pop(rid, None)
            return sources
        since = self._room_waits.setdefault(rid, time.monotonic())
        if time.monotonic() - since < self.lookup_timeout:
            return None
        self._counts["tier_staging_timeouts"] += 1
        return sources[:room]

    def _tier_lookup(self, rid: str, first: int, keys: list[bytes]) -> list[int] | None:
        """Source tier of each leading chunk of ``keys`` (chunk ``first`` on) held below the
        host tier; None while the lookup runs. Past the timeout it is a miss (``[]``)."""
        assert self.storage is not None
        if self._lookup_in_memory:
            return self.storage.lookup_now(keys)
        tl = self._tier_lookups.get(rid)
        if tl is None or tl.first != first:  # new request, or its host hits changed
            if tl is not None:
                self._lookup_ops.pop(tl.op_id, None)
            op = self.storage.lookup(keys)
            self._tier_lookups[rid] = _TierLookup(op, first, time.monotonic())
            self._lookup_ops[op] = rid
            return None
        if tl.sources is None:
            if time.monotonic() - tl.started < self.lookup_timeout:
                return None
            self._counts["tier_lookup_timeouts"] += 1
            self._lookup_ops.pop(tl.op_id, None)
            tl.sources = []
        return tl.sources[: len(keys)]

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        lookup = self._lookups.pop(rid, None)
        self._room_waits.pop(rid, None)
        self._drop_stage(rid)
        tl = self._tier_lookups.pop(rid, None)
        if tl is not None:
            self._lookup_ops.pop(tl.op_id, None)
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _RequestState(request)
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
        self._jobs[job.job_id] = _JobRecord(job, rid, missing, staged_keys, hits)
        if reads:
            self._reads_to_start.append((job.job_id, reads))
        else:
            self._loads_to_start.append(job)
        st.load_job = job.job_id

    def _group_load(
        self, request: Request, st: _RequestState, first: int, last: int, b_start: int, b_end: int
    ) -> None:
        """The load of blocks ``b_start .. b_end - 1`` (chunks ``first .. last``) in every KV
        cache group: a sliding group's blocks the window dropped (the null block) are not
        read; a chunk gone since the lookup has its blocks recomputed."""
        assert self.kvm is not None
        rid, k = request.request_id, self.blocks_per_chunk
        mgr = self._mgr()
        want: list[tuple[bytes, list[int], int]] = []
        missing: list[int] = []
        for g, table in enumerate(self.kvm.get_group_block_ids(rid)):
            keys = self._chunk_keys(request, first, last + 1, g)
            for key, i in zip(keys, range(first, last + 1), strict=True):
                b0, b1 = max(b_start, i * k), min(b_end, (i + 1) * k)
                while b0 < b1 and table[b0] == 0:  # before the window
                    b0 += 1
                if b0 == b1:
                    continue
                if mgr.lookup([key]):
                    want.append((key, table[b0:b1], b0 - i * k))
                else:
                    missing.extend(table[b0:b1])
        spec = mgr.prepare_load([w[0] for w in want])
        chunks = [
            ChunkCopy(slot, key, ids, offset)
            for slot, (key, ids, offset) in zip(spec.slots, want, strict=True)
        ]
        job = TransferJob(next(self._job_ids), is_store=False, chunks=chunks)
        self._jobs[job.job_id] = _JobRecord(job, rid, missing)
        self._loads_to_start.append(job)
        st.load_job = job.job_id

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadConnectorMetadata:
        meta = OffloadConnectorMetadata(loads=self._loads_to_start, reads=self._reads_to_start)
        self._loads_to_start, self._reads_to_start = [], []
        meta.forward = scheduler_output.total_num_scheduled_tokens > 0
        step = self._step = self._step + 1
        num_scheduled = scheduler_output.num_scheduled_tokens
        # Requests that may complete a chunk this step: those due now, and those computing
        # more than one token (prefills). The latter are found from the end of the batch
        # (the scheduler puts prefills last) until their extra tokens are all accounted for.
        check: dict[str, Request] = {}
        reqs = self._reqs
        for rid in self._due.pop(step, ()):
            st = reqs.get(rid)
            if st is not None and st.due == step:
                check[rid] = st.request
        scheduled = scheduler_output.scheduled
        extra = scheduler_output.total_num_scheduled_tokens - len(scheduled)
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
        chunks: list[ChunkCopy] = []
        store_reqs: list[str] = []
        pins: list[int] = []
        for rid, request in check.items():
            if self._plan_store(
                rid, request, num_scheduled.get(rid), scheduler_output, chunks, pins
            ):
                store_reqs.append(rid)
        if chunks:  # one job for the step: one submission, one batch of copies
            job = TransferJob(next(self._job_ids), is_store=True, chunks=chunks)
            if pins:
                assert self.kvm is not None
                self.kvm.pin_blocks(pins)
            self._jobs[job.job_id] = _JobRecord(job, "", store_reqs=store_reqs, pinned=pins)
            self._store_chunks_pending += len(chunks)
            for rid in store_reqs:
                self._reqs[rid].store_jobs.add(job.job_id)
            meta.stores.append(job)
        return meta

    def _check_at(self, rid: str, st: _RequestState, step: int) -> None:
        st.due = step
        self._due.setdefault(step, []).append(rid)

    def _plan_store(
        self,
        rid: str,
        request: Request,
        n_new: int | None,
        scheduler_output: SchedulerOutput,
        chunks: list[ChunkCopy],
        pins: list[int],
    ) -> bool:
        """Reserve the chunks ``request`` completes this step (``n_new`` tokens scheduled,
        None: not scheduled) and append their copies to ``chunks`` (True if any; the
        sliding-window blocks they read to ``pins``); set when to look at the request
        again."""
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _RequestState(request)
        if st.finished:
            return False
        step = self._step
        if st.load_job is not None:  # its tokens are being loaded: look again next step
            self._check_at(rid, st, step + 1)
            return False
        k, ct = self.blocks_per_chunk, self.chunk_tokens
        # Tokens whose KV is valid once this step's forward ran.
        done = request.num_computed_tokens + (n_new or 0)
        n_full = min(done // ct, len(request.block_hashes) // k)
        job = False
        if n_new and n_full > st.next_store_chunk:
            first, st.next_store_chunk = st.next_store_chunk, n_full
            if self.per_group:
                job = self._reserve_group_store(
                    rid, request, first, n_full, scheduler_output, chunks, pins
                )
            else:
                job = self._reserve_store(rid, request, first, n_full, scheduler_output, chunks)
        # The next chunk fills after ``next_boundary - done`` more tokens: at one token per
        # step (a decode), that many steps from now; sooner only by computing more than one
        # token in a step, which build_connector_meta catches on its own.
        self._check_at(rid, st, step + max(1, (st.next_store_chunk + 1) * ct - done))
        return job

    def _reserve_store(
        self,
        rid: str,
        request: Request,
        first: int,
        end: int,
        scheduler_output: SchedulerOutput,
        chunks: list[ChunkCopy],
    ) -> bool:
        """Reserve tier slots for chunks ``first .. end - 1`` of ``request`` not held yet
        (keys already held or being stored are skipped by the manager)."""
        k = self.blocks_per_chunk
        if self._store_chunks_pending > self.max_pending_store_chunks:
            self._counts["dropped_store_chunks"] += end - first  # earlier stores lag: drop
            return False
        keys = self._chunk_keys(request, first, end)
        metas = (
            [self._chunk_meta(request, i) for i in range(first, end)] if self.emit_events else None
        )
        mgr = self._mgr()
        out = mgr.prepare_store(keys, metas)
        block_ids = scheduler_output.block_ids[rid]
        n = len(chunks)
        if out is not None and len(out.keys_to_store) == len(keys):  # the usual case
            chunk_ids: Sequence[int] = range(first, end)
        else:
            index = {key: first + j for j, key in enumerate(keys)}
            chunk_ids = [index[key] for key in out.keys_to_store] if out is not None else []
            if self.storage is not None:  # no room in the host tier: on to storage anyway
                for key in keys:
                    if mgr.slot_of(key) is None and key not in self._spills:
                        i = index[key]
                        meta = metas[i - first] if metas is not None else None
                        self._spill(key, meta, block_ids[i * k : (i + 1) * k], chunks)
        if out is not None:
            chunks.extend(
                ChunkCopy(slot, key, block_ids[i * k : (i + 1) * k])
                for i, key, slot in zip(chunk_ids, out.keys_to_store, out.slots, strict=True)
            )
        return len(chunks) > n

    def _reserve_group_store(
        self,
        rid: str,
        request: Request,
        first: int,
        end: int,
        scheduler_output: SchedulerOutput,
        chunks: list[ChunkCopy],
        pins: list[int],
    ) -> bool:
        """:meth:`_reserve_store` for every KV cache group: each group's chunks under its own
        keys; a sliding group's chunk only while the window still holds all its blocks."""
        if self._store_chunks_pending > self.max_pending_store_chunks:
            self._counts["dropped_store_chunks"] += end - first
            return False
        k = self.blocks_per_chunk
        mgr = self._mgr()
        n = len(chunks)
        tables = scheduler_output.group_block_ids.get(rid) or [scheduler_output.block_ids[rid]]
        for g, table in enumerate(tables):
            ids_of: dict[bytes, list[int]] = {}
            metas: list[ChunkMeta] | None = [] if self.emit_events else None
            for key, i in zip(
                self._chunk_keys(request, first, end, g), range(first, end), strict=True
            ):
                ids = table[i * k : (i + 1) * k]
                if len(ids) == k and 0 not in ids:
                    ids_of[key] = ids
                    if metas is not None:
                        metas.append(self._chunk_meta(request, i, g))
            out = mgr.prepare_store(list(ids_of), metas) if ids_of else None
            sliding = self.group_windows[g] is not None
            if out is not None:
                for key, slot in zip(out.keys_to_store, out.slots, strict=True):
                    chunks.append(ChunkCopy(slot, key, ids_of[key]))
                    if sliding:
                        pins.extend(ids_of[key])
            if self.storage is not None and ids_of:  # no room in the host tier: spill
                for j, (key, ids) in enumerate(ids_of.items()):
                    if mgr.slot_of(key) is None and key not in self._spills:
                        self._spill(key, metas[j] if metas is not None else None, ids, chunks)
                        if sliding and key in self._spills:
                            pins.extend(ids)
        return len(chunks) > n

    def _spill(
        self, key: bytes, meta: ChunkMeta | None, block_ids: list[int], chunks: list[ChunkCopy]
    ) -> None:
        """A chunk the host tier had no room for: copy it to a spill slot, from where it is
        written to the storage tiers (dropped, counted, when every spill slot is in use)."""
        if not self._spill_free:
            self._counts["tier_spill_dropped_chunks"] += 1
            return
        slot = self._spill_free.pop()
        self._spills[key] = (slot, meta)
        self._counts["tier_spilled_chunks"] += 1
        chunks.append(ChunkCopy(slot, key, block_ids))

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

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._room_waits.pop(rid, None)
        self._drop_stage(rid)
        tl = self._tier_lookups.pop(rid, None)
        if tl is not None:
            self._lookup_ops.pop(tl.op_id, None)
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

    # ================================ worker side: per step ==============================
    def start_load_kv(self, metadata: OffloadConnectorMetadata | None) -> None:
        if metadata is None or self.worker is None:
            return
        if self.storage is not None:
            for job_id, items in metadata.reads:
                if job_id in self._jobs:
                    self._read_ops[self.storage.read(items)] = job_id
        loads = [job for job in metadata.loads if job.job_id in self._jobs]  # not aborted since
        if loads:
            self.worker.submit_many(loads)
        if metadata.forward:
            self.worker.forward_begins()
            if self._pause_writes and self.storage is not None:
                self.storage.pause_writes()  # kv_tier_write_pause: resumed in wait_for_save

    def wait_for_save(self, metadata: OffloadConnectorMetadata | None) -> None:
        if metadata is None or self.worker is None:
            return
        if metadata.forward:
            self.worker.forward_ends()
            if self._pause_writes and self.storage is not None:
                self.storage.resume_writes()
        if metadata.stores:
            self.worker.submit_many(metadata.stores)

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
        if self.worker is None:
            return False
        storage = self.storage
        io = storage is not None and storage.has_inflight()
        copying = any(not r.staged_keys for r in self._jobs.values())
        if io and copying:  # either can end the wait: watch both in turn, 1 ms each
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                self.worker.wait_any(0.001)
                storage.wait_any(0.001)
                if storage.has_results() or self.worker.has_results():
                    break
        elif io:
            storage.wait_any(timeout)
        elif copying:
            self.worker.wait_any(timeout)
        else:
            return False
        return True

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        if self.worker is None:
            return out
        if self.storage is not None:
            for sres in self.storage.poll():
                self._storage_done(sres, out)
            if self._write_retries:
                self._retry_writes()
        if not self.worker.has_results():  # most steps: nothing ended
            return out
        mgr = self._mgr()
        for res in self.worker.poll():
            rec = self._jobs.pop(res.job_id, None)
            if rec is None:
                continue
            job, rid = rec.job, rec.req_id
            keys = [c.key for c in job.chunks]
            if job.is_store:
                self._store_chunks_pending -= len(keys)
                if self._spills:
                    spilled = [c.key for c in job.chunks if c.slot >= self.tier.num_slots]
                    if spilled:
                        keys = [c.key for c in job.chunks if c.slot < self.tier.num_slots]
                        self._write_spilled(spilled, res.ok)
                mgr.complete_store(keys, success=res.ok)
                if rec.pinned:
                    assert self.kvm is not None
                    self.kvm.unpin_blocks(rec.pinned)
                if res.ok and self.storage is not None and keys:
                    self._cascade(keys)
                self._stats.store_bytes += res.nbytes
                self._stats.store_time_s += res.seconds
                self._counts["store_jobs"] += 1
                for rid in rec.store_reqs:
                    st = self._reqs.get(rid)
                    if st is not None:
                        st.store_jobs.discard(job.job_id)
                        self._maybe_release(rid, st, out)
                continue
            st = self._reqs.get(rid)
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
                self._maybe_release(rid, st, out)
        return out

    def _maybe_release(self, rid: str, st: _RequestState, out: KVConnectorOutput) -> None:
        """A finished request whose last job just ended: its blocks can be freed."""
        if st.finished and st.load_job is None and not st.store_jobs:
            out.finished_sending.add(rid)
            del self._reqs[rid]

    # ================================ storage tiers =====================================
    def has_pending_work(self) -> bool:
        return (
            bool(self._write_ops)
            or bool(self._write_retries)
            or bool(self._spill_ops)
            or bool(self._stage_ops)
        )

    def _write_spilled(self, keys: list[bytes], copied: bool) -> None:
        """Spilled chunks were copied to their spill slots: write them to the storage tiers
        (not retried: spills happen under pressure), then free the slots."""
        assert self.storage is not None
        slot_u8 = self.tier.slots_u8
        op = None
        if copied:
            payloads = [memoryview(slot_u8[self._spills[k][0]].numpy()) for k in keys]
            op = self.storage.write(keys, payloads)
        if op is None:
            self._free_spills(keys)
        else:
            self._spill_ops[op] = keys

    def _free_spills(self, keys: list[bytes]) -> None:
        for key in keys:
            slot, _ = self._spills.pop(key)
            self._spill_free.append(slot)

    def _cascade(self, keys: list[bytes]) -> None:
        """Chunks just stored in the host tier: write them to every storage tier. Their host
        slots are pinned (as for a load) until the write ends, so they are not reused under
        it; a write the storage worker cannot queue is dropped (counted by each tier)."""
        assert self.storage is not None
        self._mgr().prepare_load(keys)
        self._write(keys, attempt=0)

    def _write(self, keys: list[bytes], attempt: int) -> None:
        """Write pinned host chunks to the storage tiers (unpinned when the write ends)."""
        assert self.storage is not None
        mgr = self._mgr()
        slot_u8 = self.tier.slots_u8
        payloads = [memoryview(slot_u8[mgr.slot_of(k)].numpy()) for k in keys]
        op = self.storage.write(keys, payloads)
        if op is None:
            mgr.complete_load(keys)
        else:
            self._write_ops[op] = (keys, attempt)

    def _retry_writes(self) -> None:
        """Writes that reached no tier, once their retry time came (a tier down for a moment:
        a server restarting, a disk briefly full)."""
        now = time.monotonic()
        while self._write_retries and self._write_retries[0][0] <= now:
            _, keys = self._write_retries.popleft()
            self._write(keys, attempt=1)

    def _storage_done(self, res: StorageResult, out: KVConnectorOutput) -> None:
        """Apply one finished storage operation (engine thread)."""
        stage = self._stage_ops.pop(res.op_id, None)
        if stage is not None:
            if res.kind == "read":
                self._stage_read_done(stage, res)
            else:
                groups = stage.lookups.pop(res.op_id)
                runs = res.runs + [[]] * (len(groups) - len(res.runs))  # failed: misses
                for g, sources in zip(groups, runs, strict=False):
                    stage.sources[g] = sources
            return
        if res.kind == "lookup":
            rid = self._lookup_ops.pop(res.op_id, None)
            tl = self._tier_lookups.get(rid) if rid is not None else None
            if tl is not None and tl.op_id == res.op_id:
                tl.sources = res.sources
        elif res.kind == "write" and res.op_id in self._spill_ops:
            keys = self._spill_ops.pop(res.op_id)
            if self.emit_events:
                for t, stored in res.stored.items():
                    self._emit_tier_stored(t, [self._spills[k][1] for k in stored], stored)
            self._free_spills(keys)
        elif res.kind == "write":
            keys, attempt = self._write_ops.pop(res.op_id, ([], 0))
            mgr = self._mgr()
            if self.emit_events:
                for t, stored in res.stored.items():
                    self._emit_tier_stored(t, [mgr.meta_of(k) for k in stored], stored)
            ok = res.ok if len(res.ok) == len(keys) else [False] * len(keys)
            failed = [k for k, g in zip(keys, ok, strict=True) if not g]
            mgr.complete_load([k for k, g in zip(keys, ok, strict=True) if g])
            if failed and attempt == 0:  # keep them pinned: retried once, later
                self._counts["tier_write_retried_chunks"] += len(failed)
                self._write_retries.append((time.monotonic() + self.write_retry_delay_s, failed))
            elif failed:
                self._counts["tier_write_failed_chunks"] += len(failed)
                logger.warning(
                    "%d KV chunk(s) reached no storage tier, even retried: not written",
                    len(failed),
                )
                mgr.complete_load(failed)
        elif res.kind == "read":
            job_id = self._read_ops.pop(res.op_id, None)
            rec = self._jobs.get(job_id) if job_id is not None else None
            if rec is not None:
                self._staged(rec, res, out)

    def _staged(self, rec: _JobRecord, res: StorageResult, out: KVConnectorOutput) -> None:
        """Storage chunks of a load are in host slots (or failed): make the good leading run
        host-tier chunks, then copy the load into the primary pool like any host hit."""
        mgr = self._mgr()
        n_ok = 0
        while n_ok < len(res.ok) and res.ok[n_ok]:
            n_ok += 1
        good, bad = rec.staged_keys[:n_ok], rec.staged_keys[n_ok:]
        job, first = rec.job, rec.staged_from
        slots = [c.slot for c in job.chunks[first : first + n_ok]]
        self._settle_staged(mgr, slots, good, bad, res, f"request {rec.req_id}: ")
        rec.staged_keys = []
        host_keys = [c.key for c in job.chunks[:first]]
        if rec.cancelled:
            mgr.complete_load(host_keys)
            del self._jobs[job.job_id]
            return
        # Chunks after the first failed one are recomputed with the blocks never loaded.
        for c in job.chunks[first + n_ok :]:
            rec.missing_blocks.extend(c.block_ids)
        job.chunks = job.chunks[: first + n_ok]
        if good:
            mgr.prepare_load(good)  # pinned for the copy, like the host hits
        if job.chunks:
            assert self.worker is not None
            self.worker.submit(job)
            return
        # Nothing to copy: the load ends here, every block of it recomputed.
        del self._jobs[job.job_id]
        st = self._reqs.get(rec.req_id)
        if st is not None:
            st.load_job = None
            if not st.finished:
                out.finished_recving.add(rec.req_id)
                out.invalid_block_ids.update(rec.missing_blocks)

    def _emit_tier_stored(self, t: int, metas: list[ChunkMeta | None], keys: list[bytes]) -> None:
        tier = self.tiers[t]
        for key, m in zip(keys, metas, strict=True):
            if m is None:
                continue
            if not tier.shared:
                self._tier_blocks[t][key] = (m.block_hashes, m.group_idx)
            self._events.append(
                BlockStored(
                    block_hashes=list(m.block_hashes),
                    parent_block_hash=m.parent_block_hash,
                    token_ids=list(m.token_ids),
                    block_size=self.block_size,
                    medium=tier.medium,
                    lora_name=m.lora_name,
                    extra_keys=m.extra_keys,
                    group_idx=m.group_idx,
                    kv_cache_spec_kind=m.kv_cache_spec_kind,
                    kv_cache_spec_sliding_window=m.kv_cache_spec_sliding_window,
                    **tier.event_fields(),
                )
            )

    def _collect_tier_evictions(self) -> None:
        for t, tier in enumerate(self.tiers):
            evicted = tier.take_evicted()
            blocks = self._tier_blocks[t]
            for key in evicted:
                held = blocks.pop(key, None)
                if held is not None and self.emit_events:
                    hashes, group = held
                    self._events.append(
                        BlockRemoved(
                            block_hashes=hashes,
                            medium=tier.medium,
                            group_idx=group,
                            **tier.event_fields(),
                        )
                    )

    def shutdown(self) -> None:
        if self.storage is not None:
            self.storage.shutdown()
            self.storage = None
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
        if self.manager is not None:
            self.tier.close()
