"""The simulator's host-memory offload tier: the real offloading connector, modelled transfers.

Owns :class:`SimOffloadingConnector` (registered as ``"sim-offload"``), a
:class:`SimTierBackend` that has slots but no storage, and :class:`SimTransferWorker`, whose
jobs complete after ``latency + bytes / bandwidth`` (times ``time_scale``) instead of copying.
Everything else is the engine's own offloading code: lookups, loads that park the request in
WAITING_FOR_REMOTE_KVS, stores after the step, the :class:`OffloadingManager` with its
eviction policy (LRU/ARC) and its CPU-medium KV events. So the sim's tier hits, evictions and
events are the real ones; only the time a copy takes is modelled.

Links: loads (host -> primary) and stores (primary -> host) each have their own link (PCIe is
full duplex); jobs on one link run one after another in submission order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvserve.config import GiB
from kvserve.kv.backends.base import Backend, ChunkHeader, ChunkLayout
from kvserve.kv.connector import register_connector
from kvserve.kv.events import MEDIUM_CPU
from kvserve.kv.offload.connector import OffloadingConnector
from kvserve.kv.offload.manager import OffloadingManager
from kvserve.kv.offload.worker import TransferJob, TransferResult
from kvserve.sim.latency_model import LatencyModel, get_preset

if TYPE_CHECKING:
    from kvserve.config import EngineConfig


class SimTierBackend(Backend):
    """``num_slots`` chunk slots of the modelled size, holding no data."""

    name = "sim-cpu"
    medium = MEDIUM_CPU

    def __init__(self, layout: ChunkLayout, num_slots: int, chunk_bytes: int) -> None:
        super().__init__(layout, num_slots)
        self.chunk_bytes = chunk_bytes
        self.pinned = False

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.chunk_bytes

    def write_chunk(self, slot: int, data, header: ChunkHeader) -> None:
        raise NotImplementedError("the simulated tier holds no KV data (transfers are timed)")

    def read_chunk(self, slot: int, out) -> ChunkHeader | None:
        raise NotImplementedError("the simulated tier holds no KV data (transfers are timed)")


class SimTransferWorker:
    """Transfer jobs that finish at their modelled time (the ``TransferWorker`` interface)."""

    def __init__(self, latency: LatencyModel, block_bytes: int, time_scale: float = 1.0) -> None:
        self.latency = latency
        self.block_bytes = block_bytes
        self.time_scale = time_scale
        self._lock = threading.Lock()
        self._link_free = {True: 0.0, False: 0.0}  # is_store -> time the link is free again
        # job_id -> [start, end, job, modelled seconds, cancelled]
        self._jobs: dict[int, list] = {}

    def submit(self, job: TransferJob) -> None:
        modelled = self.latency.transfer_time(job.num_blocks * self.block_bytes)
        with self._lock:
            now = time.monotonic()
            start = max(now, self._link_free[job.is_store])
            end = start + modelled * self.time_scale
            self._link_free[job.is_store] = end
            self._jobs[job.job_id] = [start, end, job, modelled, False]

    def submit_many(self, jobs: Iterable[TransferJob]) -> None:
        for job in jobs:
            self.submit(job)

    def has_results(self) -> bool:
        now = time.monotonic()
        with self._lock:
            return any(e[1] <= now for e in self._jobs.values())

    def forward_begins(self) -> None:
        """Nothing to schedule around: a modelled transfer takes no engine CPU."""

    def forward_ends(self) -> None:
        """See :meth:`forward_begins`."""

    def poll(self) -> list[TransferResult]:
        now = time.monotonic()
        out = []
        with self._lock:
            for jid in [j for j, e in self._jobs.items() if e[1] <= now]:
                _, _, job, modelled, cancelled = self._jobs.pop(jid)
                if cancelled:
                    out.append(TransferResult(jid, ok=False, cancelled=True))
                else:
                    nbytes = job.num_blocks * self.block_bytes
                    out.append(TransferResult(jid, True, [], nbytes, modelled))
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        with self._lock:
            ends = [self._jobs[j][1] for j in job_ids if j in self._jobs]
        if ends:
            time.sleep(max(0.0, max(ends) - time.monotonic()))

    def wait_any(self, timeout: float) -> None:
        """Sleep until the earliest job's modelled end (at most ``timeout``)."""
        with self._lock:
            first = min((e[1] for e in self._jobs.values()), default=None)
        if first is not None:
            time.sleep(min(timeout, max(0.0, first - time.monotonic())))

    def cancel(self, job_ids: Iterable[int]) -> set[int]:
        """Drop jobs that have not started; the next poll reports them cancelled."""
        now = time.monotonic()
        with self._lock:
            ids = {j for j in job_ids if j in self._jobs and self._jobs[j][0] > now}
            for j in ids:
                self._jobs[j][1] = now
                self._jobs[j][4] = True
        return ids

    def shutdown(self) -> None:
        with self._lock:
            self._jobs.clear()


@register_connector("sim-offload")
class SimOffloadingConnector(OffloadingConnector):
    """:class:`OffloadingConnector` over a :class:`SimTierBackend` and timed transfers.

    The latency model and time scale come from the engine config's ``sim_latency`` /
    ``sim_time_scale`` attributes (set by :class:`~kvserve.sim.instance.SimEngineConfig`).
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        latency = getattr(config, "sim_latency", None)
        self.latency: LatencyModel = (
            get_preset(latency) if isinstance(latency, str) else latency or get_preset("cpu-tiny")
        )
        self.time_scale = float(getattr(config, "sim_time_scale", 1.0))

    def register_kv_caches(self, kv_caches) -> None:
        block_bytes = int(getattr(kv_caches, "block_bytes", 0)) or self.latency.block_bytes(
            self.block_size
        )
        chunk_bytes = block_bytes * self.blocks_per_chunk
        num_slots = self.size_bytes // chunk_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offload_size {self.size_bytes / GiB:.3f} GiB is smaller than one offload "
                f"chunk ({chunk_bytes} bytes of modelled KV); raise it"
            )
        # Shape of the modelled chunk: one "layer" of block_size tokens x block_bytes/token.
        layout = ChunkLayout(
            1,
            self.block_size,
            1,
            max(1, block_bytes // self.block_size),
            "uint8",
            self.blocks_per_chunk,
        )
        self.tier = SimTierBackend(layout, num_slots, chunk_bytes)
        self.manager = OffloadingManager(
            self.tier, self.policy_name, block_size=self.block_size, emit_events=self.emit_events
        )
        self.worker = SimTransferWorker(self.latency, block_bytes, self.time_scale)  # type: ignore[assignment]
