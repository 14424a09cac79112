"""The simulator's P/D transfer: vLLM's ``kv_transfer_params`` contract, modelled KV transfers.

Owns :class:`SimPDConnector` (registered as ``"sim-pd"``, chained with the simulated host
tier when there is one; a simulated engine with a ``kv_role`` gets it in place of the real
``pd`` connector, whose TCP transport needs real KV tensors). The request flow is the real
one: a prefill instance (producer) finishes a ``do_remote_decode`` request, holds its full
prompt blocks under a lease (the engine's own :class:`~kvserve.kv.pd.leases.LeaseTable`:
released on pull, abort or timeout) and returns the decode leg's parameters
(:mod:`kvserve.kv.pd.params`); a decode instance (consumer) admits the decode leg, loads the
blocks past its own prefix hit asynchronously (the request waits in WAITING_FOR_REMOTE_KVS,
other requests run) and then decodes. Only the copy is modelled: the simulated instances
share one process, so the consumer takes the producer's lease straight from a process-wide
registry, and the pull ends ``net_latency + bytes / net_bandwidth`` (times the time scale)
after it can start. Each instance has one network link each way (a NIC, full duplex): a pull
waits for the producer's outbound and the consumer's inbound link, and occupies both.
Parameters naming another prompt (chain hash) or an unknown lease are refused: the decode
instance prefills itself, as the real connector does.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.engine.request import RequestStatus
from kvserve.kv.connector import (
    CONNECTORS,
    KVConnectorBase,
    KVConnectorOutput,
    KVConnectorStats,
)
from kvserve.kv.pd import params as pdp
from kvserve.kv.pd.leases import Lease, LeaseTable
from kvserve.sim.latency_model import LatencyModel, get_preset

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.engine.outputs import SchedulerOutput
    from kvserve.engine.request import Request

_LEASABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
SIM_HOST = "sim.invalid"  # the parameters' host: nothing listens; the registry is the wire


class _Network:
    """Process-wide: producers' leases by id, and when each instance's links are free."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.producers: dict[str, SimPDConnector] = {}  # engine id -> producer
        self.link_free: dict[tuple[str, str], float] = {}  # (engine id, "in"/"out") -> time

    def reserve(self, src: str, dst: str, seconds: float) -> tuple[float, float]:
        """A transfer of ``seconds`` from ``src`` to ``dst``: (start, end) wall times."""
        with self.lock:
            now = time.monotonic()
            start = max(now, self.link_free.get((src, "out"), 0.0))
            start = max(start, self.link_free.get((dst, "in"), 0.0))
            end = start + seconds
            self.link_free[(src, "out")] = self.link_free[(dst, "in")] = end
            return start, end


NETWORK = _Network()


@dataclass(eq=False)
class _Pull:
    req_id: str
    lease: Lease | None  # None: refused (nothing to pull: recompute)
    producer: SimPDConnector | None
    block_ids: list[int]  # the consumer's destination blocks
    nbytes: int
    modelled_s: float
    end: float  # wall time the modelled copy ends


@dataclass
class _Counts:
    pulls: int = 0
    pulls_ok: int = 0
    pulls_failed: int = 0
    blocks_pulled: int = 0
    leases_created: int = 0


class SimPDConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        latency = getattr(config, "sim_latency", None)
        self.latency: LatencyModel = (
            get_preset(latency) if isinstance(latency, str) else latency or get_preset("cpu-tiny")
        )
        self.time_scale = float(getattr(config, "sim_time_scale", 1.0))
        role = config.kv_role or "both"
        self.is_producer = role in ("producer", "both")
        self.is_consumer = role in ("consumer", "both")
        self.block_size = config.block_size
        self.block_bytes = self.latency.block_bytes(self.block_size)
        self.engine_id = config.kv_engine_id or uuid.uuid4().hex
        self.fingerprint = f"sim:{self.latency.name}:{config.prefix_hash_seed}"
        self.wakeup = threading.Event()
        self.leases = LeaseTable(config.kv_lease_timeout, self.wakeup) if self.is_producer else None
        self._lookups: dict[str, int] = {}  # request -> its primary-pool hit (tokens)
        self._pulls: dict[str, _Pull] = {}
        self._tried: set[str] = set()
        self._params_out: dict[str, dict[str, Any]] = {}
        self._counts = _Counts()
        self._load_bytes = 0
        self._load_time_s = 0.0
        if self.is_producer:
            with NETWORK.lock:
                NETWORK.producers[self.engine_id] = self

    # ---------------- scheduler side ----------------
    def check_kv_transfer_params(self, params: dict[str, Any]) -> None:
        pdp.check(params)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._lookups.pop(rid, None)
        if not self.is_consumer or rid in self._tried:
            return 0, False
        remote = pdp.parse_remote_prefill(request.kv_transfer_params)
        if remote is None:
            return 0, False
        n, _ = remote.usable_blocks(request.block_hashes, self.fingerprint, self.block_size)
        end = min(n * self.block_size, request.num_tokens - 1)
        if end - num_computed_tokens <= 0:
            return 0, False
        self._lookups[rid] = num_computed_tokens
        return end - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        num_computed = self._lookups.pop(rid, 0)
        if not self.is_consumer or rid in self._tried:
            return
        remote = pdp.parse_remote_prefill(request.kv_transfer_params)
        if remote is None:
            return
        self._tried.add(rid)
        with NETWORK.lock:
            producer = NETWORK.producers.get(remote.engine_id)
        lease = None
        if producer is not None and producer.leases is not None:
            lease = producer.leases.take(remote.lease_id)
        if num_external_tokens <= 0:  # nothing needed (own prefix hit): free the producer's
            if lease is not None and producer is not None and producer.leases is not None:
                producer.leases.release(lease)
            return
        bs = self.block_size
        start = num_computed // bs
        end = -(-(num_computed + num_external_tokens) // bs)
        dst = list(block_ids[start:end])
        nbytes = len(dst) * self.block_bytes
        modelled = self.latency.net_transfer_time(nbytes)
        self._counts.pulls += 1
        if lease is None:  # expired, unknown: every block recomputed
            self._pulls[rid] = _Pull(rid, None, None, dst, 0, 0.0, time.monotonic())
            return
        _, wall_end = NETWORK.reserve(remote.engine_id, self.engine_id, modelled * self.time_scale)
        self._pulls[rid] = _Pull(rid, lease, producer, dst, nbytes, modelled, wall_end)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> None:
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._tried.discard(rid)
        pull = self._pulls.pop(rid, None)
        if pull is not None:  # aborted while pulling: nothing is in flight for real
            self._end_pull(pull)
        params = request.kv_transfer_params
        if not (self.is_producer and pdp.wants_remote_decode(params)):
            return False
        if request.status not in _LEASABLE:
            return False
        assert self.leases is not None
        bs = self.block_size
        n = pdp.offered_blocks(request, block_ids, bs)
        lease_id = "none"
        if n:
            lease_id = self.leases.add(rid, block_ids[:n], request.block_hashes[:n]).lease_id
            self._counts.leases_created += 1
        self._params_out[rid] = pdp.decode_leg_params(
            engine_id=self.engine_id,
            host=SIM_HOST,
            port=1,
            lease_id=lease_id,
            block_ids=block_ids[:n],
            block_size=bs,
            fingerprint=self.fingerprint,
            last_block_hash=request.block_hashes[n - 1] if n else None,
        )
        return n > 0

    def get_finished_kv_transfer_params(self, request: Request) -> dict[str, Any] | None:
        return self._params_out.pop(request.request_id, None)

    def _end_pull(self, pull: _Pull) -> None:
        if pull.lease is not None and pull.producer is not None:
            assert pull.producer.leases is not None
            pull.producer.leases.release(pull.lease)  # wakes the producer's engine

    def stats(self) -> KVConnectorStats:
        c = self._counts
        extra = {
            "pd_pulls": c.pulls,
            "pd_pulls_ok": c.pulls_ok,
            "pd_pulls_failed": c.pulls_failed,
            "pd_blocks_pulled": c.blocks_pulled,
            "pd_leases_created": c.leases_created,
            "pd_leases_active": self.leases.num_active if self.leases else 0,
        }
        return KVConnectorStats(
            load_bytes=self._load_bytes,
            load_time_s=self._load_time_s,
            extra={k: float(v) for k, v in extra.items()},
        )

    # ---------------- worker side ----------------
    def wait_for_transfers(self, timeout: float) -> bool:
        busy = bool(self._pulls) or (self.leases is not None and self.leases.has_active())
        if not busy:
            return False
        first = min((p.end for p in self._pulls.values()), default=None)
        if first is not None:
            timeout = min(timeout, max(0.0, first - time.monotonic()))
        self.wakeup.wait(timeout)
        return True

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        self.wakeup.clear()
        out = KVConnectorOutput()
        if self.leases is not None:
            self.leases.expire()
            out.finished_sending.update(self.leases.take_released())
        now = time.monotonic()
        for rid in [r for r, p in self._pulls.items() if p.end <= now]:
            pull = self._pulls.pop(rid)
            self._end_pull(pull)
            out.finished_recving.add(rid)
            if pull.lease is None:
                self._counts.pulls_failed += 1
                out.invalid_block_ids.update(pull.block_ids)
                continue
            self._counts.pulls_ok += 1
            self._counts.blocks_pulled += len(pull.block_ids)
            self._load_bytes += pull.nbytes
            self._load_time_s += pull.modelled_s
        return out

    def shutdown(self) -> None:
        with NETWORK.lock:
            if NETWORK.producers.get(self.engine_id) is self:
                del NETWORK.producers[self.engine_id]
        if self.leases is not None:
            self.leases.release_all()


def create_sim_pd_connector(config: EngineConfig) -> KVConnectorBase:
    """``sim-pd``, chained with the simulated host tier when one is configured."""
    from kvserve.kv.multi_connector import chain_with_offload
    from kvserve.sim.offload import SimOffloadingConnector

    return chain_with_offload(SimPDConnector(config), SimOffloadingConnector, config)


CONNECTORS["sim-pd"] = create_sim_pd_connector
