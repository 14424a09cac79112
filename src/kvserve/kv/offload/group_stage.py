"""KV cache groups in the offloading connector (hybrid models, see
:mod:`kvserve.engine.kv_cache_spec`): which chunks a hit needs, staging storage-tier hits per
group, and per-group loads and stores.

Every group stores its own chunks (keys :func:`~kvserve.kv.backends.chunk_format.group_chunk_key`,
events with the group); a lookup hits where the full-attention groups hold every chunk and each
sliding-window group the chunks covering the window before the hit point, and a load reads only
those for a sliding group (its blocks before the window are the null block). A sliding group's
blocks are freed by the window only in whole chunks, once the chunk is complete and its store
planned; a store pins the sliding blocks it reads until it ends. Storage tiers hold every
group's chunks too (the cascade writes each under its group's key); a storage hit is staged into
host slots before the request is allocated (:class:`GroupStage`: lookups per group, then one
read of only the chunks the hit needs, a sliding group's window), so a chunk that fails to read
is a shorter hit. The P/D connector moves KV per group by the same hit rule (kv/pd/).

:class:`GroupOffloading` is a part of :class:`~kvserve.kv.offload.connector.OffloadingConnector`
(its state is the connector's); it is used only when ``per_group`` is set.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.kv.offload.connector_state import JobRecord, RequestState
from kvserve.kv.offload.manager import ChunkMeta
from kvserve.kv.offload.storage_worker import ReadItem, StorageResult
from kvserve.kv.offload.worker import ChunkCopy, TransferJob, WholeChunks

if TYPE_CHECKING:
    from kvserve.engine.outputs import SchedulerOutput
    from kvserve.engine.request import Request


@dataclass
class GroupStage:
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


class GroupOffloading:
    """The per-group paths of the offloading connector (methods of the connector)."""

    def _group_hits(
        self, request: Request, first: int, end: int, stage: GroupStage | None = None
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
        self, request: Request, first: int, end: int, stage: GroupStage | None = None
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

    def _start_group_stage(self, request: Request, first: int, n_usable: int) -> GroupStage:
        """A stage for a hit of chunks ``first .. n_usable - 1``, its lookups started."""
        num_groups = len(self.group_windows)
        stage = GroupStage(
            first, time.monotonic(), [first] * num_groups, [[] for _ in range(num_groups)]
        )
        stage.end = n_usable
        self._stage_lookups(stage, request, range(num_groups))
        return stage

    def _stage_lookups(self, stage: GroupStage, request: Request, groups: Iterable[int]) -> None:
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

    def _stage_read_done(self, stage: GroupStage, res: StorageResult) -> None:
        """A stage's chunks are in host slots (or failed): the verified ones are host-tier
        chunks from now on, the others are dropped (a miss: a shorter hit)."""
        mgr = self._mgr()
        ok = list(res.ok) + [False] * (len(stage.keys) - len(res.ok))
        good = [k for k, g in zip(stage.keys, ok, strict=False) if g]
        bad = [k for k, g in zip(stage.keys, ok, strict=False) if not g]
        slots = [s for s, g in zip(stage.slots, ok, strict=False) if g]
        self._settle_staged(mgr, slots, good, bad, res, "")
        stage.keys, stage.slots, stage.reading, stage.done = [], [], False, True

    def _group_load(
        self, request: Request, st: RequestState, first: int, last: int, b_start: int, b_end: int
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
        self._jobs[job.job_id] = JobRecord(job, rid, missing)
        self._loads_to_start.append(job)
        st.load_job = job.job_id

    def _reserve_group_store(
        self,
        rid: str,
        request: Request,
        first: int,
        end: int,
        scheduler_output: SchedulerOutput,
        chunks: WholeChunks,
        pins: list[int],
    ) -> bool:
        """:meth:`_reserve_stores` for every KV cache group: each group's chunks under its own
        keys; a sliding group's chunk only while the window still holds all its blocks."""
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
                    chunks.add(slot, key, ids_of[key])
                    if sliding:
                        pins.extend(ids_of[key])
            if self.storage is not None and ids_of:  # no room in the host tier: spill
                for j, (key, ids) in enumerate(ids_of.items()):
                    if mgr.slot_of(key) is None and key not in self._spills:
                        self._spill(key, metas[j] if metas is not None else None, ids, chunks)
                        if sliding and key in self._spills:
                            pins.extend(ids)
        return len(chunks) > n
