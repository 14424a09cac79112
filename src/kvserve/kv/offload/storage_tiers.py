"""The offloading connector's side of the storage tiers below the host tier (local disk, a
shared file system, Redis/Valkey; :mod:`kvserve.kv.backends`).

The host tier stays the gateway (as in vLLM's multi-tier offloading): every chunk stored in
host memory is cascaded to every storage tier by the
:class:`~kvserve.kv.offload.storage_worker.StorageWorker` (asynchronous, bounded: a write that
finds the queue full is dropped and counted; a write that reached no tier is retried once,
``WRITE_RETRY_DELAY_S`` later); a chunk the host tier had no
room for is copied to a spill slot and written from there. A lookup asks the host tier, then
the storage tiers for the chunks after its hits (asynchronously: the scheduler is told to ask
again while the lookup runs, and a lookup slower than ``kv_tier_lookup_timeout`` is a miss); a
storage hit is staged into host-tier slots (reserved like a store, verified by the tier with a
full-content hash) and then loaded like any host hit, so it stays in host memory for the next
request. A failed or partial read is recomputed (``invalid_block_ids``), exactly like a host
chunk that fails verification. Stored and evicted chunks of the tiers are published as KV
events.

:class:`StorageTiers` is a part of :class:`~kvserve.kv.offload.connector.OffloadingConnector`
(its state is the connector's); it is used only when storage tiers are configured.
"""

from __future__ import annotations

import logging
import time

from kvserve.kv.connector import KVConnectorOutput
from kvserve.kv.events import BlockRemoved
from kvserve.kv.offload.connector_state import JobRecord, TierLookup
from kvserve.kv.offload.manager import ChunkMeta, OffloadingManager, finish_extra_keys
from kvserve.kv.offload.storage_worker import StorageResult
from kvserve.kv.offload.worker import WholeChunks

logger = logging.getLogger(__name__)

# A cascade write that reached no storage tier is retried once, this long after it ended.
WRITE_RETRY_DELAY_S = 1.0
# Most host slots kept for chunks on their way to the storage tiers that the host tier had
# no room for (an eighth of the host tier at most).
MAX_SPILL_SLOTS = 32


class StorageTiers:
    """Storage-tier lookups, staging, writes and events (methods of the connector)."""

    # ---------------- scheduler side: lookups below the host tier ----------------
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
            self._tier_lookups[rid] = TierLookup(op, first, time.monotonic())
            self._lookup_ops[op] = rid
            return None
        if tl.sources is None:
            if time.monotonic() - tl.started < self.lookup_timeout:
                return None
            self._counts["tier_lookup_timeouts"] += 1
            self._lookup_ops.pop(tl.op_id, None)
            tl.sources = []
        return tl.sources[: len(keys)]

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

    # ---------------- staging storage hits into host slots ----------------
    def _staged(self, rec: JobRecord, res: StorageResult, out: KVConnectorOutput) -> None:
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

    # ---------------- the write cascade and spills ----------------
    def has_pending_work(self) -> bool:
        return (
            bool(self._write_ops)
            or bool(self._write_retries)
            or bool(self._spill_ops)
            or bool(self._stage_ops)
        )

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

    def _spill(
        self, key: bytes, meta: ChunkMeta | None, block_ids: list[int], chunks: WholeChunks
    ) -> None:
        """A chunk the host tier had no room for: copy it to a spill slot, from where it is
        written to the storage tiers (dropped, counted, when every spill slot is in use)."""
        if not self._spill_free:
            self._counts["tier_spill_dropped_chunks"] += 1
            return
        slot = self._spill_free.pop()
        self._spills[key] = (slot, meta)
        self._counts["tier_spilled_chunks"] += 1
        chunks.add(slot, key, block_ids)

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

    # ---------------- completions and events ----------------
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

    def _emit_tier_stored(self, t: int, metas: list[ChunkMeta | None], keys: list[bytes]) -> None:
        tier = self.tiers[t]
        for key, m in zip(keys, metas, strict=True):
            if m is None:
                continue
            if not tier.shared:
                self._tier_blocks[t][key] = (m.block_hashes, m.group_idx)
            event = m.stored_event(self.block_size, tier.medium, **tier.event_fields())
            self._events.append(finish_extra_keys(event))

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
