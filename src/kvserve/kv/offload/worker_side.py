"""The offloading connector's worker side: transfers, once per engine step; owns the
:class:`~kvserve.kv.offload.worker.TransferWorker`.

Starts loads (and storage reads into host slots) before the forward, submits stores after
sampling, flushes the stores of preempted requests before their blocks are reused, and reports
finished jobs. A chunk that fails verification on load is dropped from the tier and its blocks
(and the following ones of that load) are reported in ``invalid_block_ids``: the request
recomputes them, the output never changes. Job completions are applied to the manager in
:meth:`WorkerSide.get_finished` (the engine calls it every step). Before that, a step that
computed nothing (only transfers in flight) calls :meth:`WorkerSide.wait_for_transfers`, which
sleeps on the transfer worker until a job ends: an engine that spins instead holds the GIL and
starves the transfer thread.

:class:`WorkerSide` is a part of :class:`~kvserve.kv.offload.connector.OffloadingConnector`
(its state is the connector's).
"""

from __future__ import annotations

import logging
import time

from kvserve.kv.connector import NO_TRANSFERS, KVConnectorOutput
from kvserve.kv.offload.connector_state import OffloadConnectorMetadata, RequestState

logger = logging.getLogger(__name__)


class WorkerSide:
    """Per-step transfers and their completions (methods of the connector)."""

    def idle_step(self, metadata: OffloadConnectorMetadata | None) -> bool:
        # A forward with nothing to load or store (the shared quiet metadata), no job in
        # flight (whose completion get_finished would apply, whose store a forward pass would
        # hold back), no storage tier (its reads and writes are polled every step).
        return metadata is self._quiet_meta[1] and not self._jobs and self.storage is None

    def start_load_kv(self, metadata: OffloadConnectorMetadata | None) -> None:
        if metadata is None or self.worker is None:
            return
        if metadata.reads and self.storage is not None:
            for job_id, items in metadata.reads:
                if job_id in self._jobs:
                    self._read_ops[self.storage.read(items)] = job_id
        if metadata.loads:
            loads = [job for job in metadata.loads if job.job_id in self._jobs]  # not aborted
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
        if self.worker is None:
            return KVConnectorOutput()
        if self.storage is None and not self.worker.has_results():
            return NO_TRANSFERS  # most steps: nothing ended
        out = KVConnectorOutput()
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
            keys = job.keys
            if job.is_store:
                self._store_chunks_pending -= len(keys)
                if self._spills:
                    n = self.tier.num_slots
                    spilled = [k for k, s in zip(keys, job.slots, strict=True) if s >= n]
                    if spilled:
                        keys = [k for k, s in zip(keys, job.slots, strict=True) if s < n]
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

    def _maybe_release(self, rid: str, st: RequestState, out: KVConnectorOutput) -> None:
        """A finished request whose last job just ended: its blocks can be freed."""
        if st.finished and st.load_job is None and not st.store_jobs:
            out.finished_sending.add(rid)
            del self._reqs[rid]
