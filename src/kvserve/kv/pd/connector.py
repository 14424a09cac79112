"""The ``pd`` connector: prefill/decode disaggregation as a KV connector.

Selected by ``kv_role`` (producer | consumer | both) or ``kv_transfer_config``; with
``kv_offload_size > 0`` it is chained with the offloading connector
(:class:`~kvserve.kv.multi_connector.MultiConnector`: loads asked here first, stores go to the
host tier).

Producer (prefill engine): a request with ``kv_transfer_params: {"do_remote_decode": true}``
runs normally. When it finishes, its full prompt blocks stay allocated under a lease
(:mod:`.leases`; ``request_finished`` returns True) and its output carries the decode leg's
``kv_transfer_params`` (:mod:`.params`). The block server (:mod:`.transfer_server`) serves the
lease to one pull; the lease's end is reported in ``finished_sending`` and the blocks are freed.

Consumer (decode engine): a request with ``do_remote_prefill`` parameters loads the producer's
blocks past its own primary-pool hit (never blocks it holds, never the last prompt token) as an
asynchronous load: the scheduler allocates the blocks, the request waits in
WAITING_FOR_REMOTE_KVS, a pull thread (:mod:`.transfer_client`) receives the blocks into them,
and ``finished_recving`` makes it runnable. Blocks that did not arrive verified are reported in
``invalid_block_ids`` and recomputed. A request pulls at most once (a lease serves one pull);
when it needs nothing of the lease (its own cache holds the prefix, or the parameters name
another model or prompt), the producer is told at once so its blocks are freed.

KV cache groups (a hybrid model, :mod:`kvserve.engine.kv_cache_spec`): the producer leases, per
group, the blocks a hit at the end of the offered prompt blocks needs (the spec's
``num_skipped_blocks``: a full-attention group every block, a sliding-window group only its
window; the others are freed already) and names them per group in ``remote_block_ids``; the
consumer pulls, in one pull of several index ranges, each group's needed blocks past its own hit
into the blocks the scheduler allocated for that group. A sliding group moves only its window's
bytes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.engine.request import RequestStatus
from kvserve.kv.backends.base import ChunkLayout
from kvserve.kv.backends.chunk_format import fingerprint_model_dir, kv_groups_identity
from kvserve.kv.connector import (
    CONNECTORS,
    KVConnectorBase,
    KVConnectorOutput,
    KVConnectorStats,
)
from kvserve.kv.pd import params as pdp
from kvserve.kv.pd.block_memory import BlockMemory
from kvserve.kv.pd.leases import LeaseTable
from kvserve.kv.pd.transfer_client import TcpPuller
from kvserve.kv.pd.transfer_server import TcpBlockServer
from kvserve.kv.pd.transport import PullJob

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.engine.kv_cache_manager import KVCacheManager
    from kvserve.engine.kv_cache_spec import KVCacheSpec
    from kvserve.engine.outputs import SchedulerOutput
    from kvserve.engine.request import Request

logger = logging.getLogger(__name__)

# Finished statuses whose KV is complete (an aborted prefill is not offered).
_LEASABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


@dataclass
class PDConnectorMetadata:
    """One step's pulls to start (scheduler side -> worker side)."""

    pulls: list[PullJob] = field(default_factory=list)


@dataclass
class _Lookup:
    remote: pdp.RemotePrefill
    num_computed_tokens: int


@dataclass(eq=False)
class _Pull:
    job: PullJob
    finished: bool = False  # the request ended while pulling: its blocks are held until then


@dataclass
class _Counts:
    pulls: int = 0
    pulls_ok: int = 0
    pulls_failed: int = 0
    blocks_pulled: int = 0  # verified
    blocks_invalid: int = 0  # asked for, recomputed
    refused: int = 0  # decode legs whose parameters could not be used (recomputed)
    releases: int = 0  # leases handed back unpulled (nothing needed)
    pull_cpu_s: float = 0.0  # CPU time of the pull threads


class PDConnector(KVConnectorBase):
    """Producer and/or consumer side of P/D, over the TCP transport."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        role = config.kv_role or "both"
        self.is_producer = role in ("producer", "both")
        self.is_consumer = role in ("consumer", "both")
        self.block_size = config.block_size
        self.engine_id = config.kv_engine_id or uuid.uuid4().hex
        self.wakeup = threading.Event()  # set by transport threads when something ended
        self.leases = LeaseTable(config.kv_lease_timeout, self.wakeup) if self.is_producer else None
        self.memory: BlockMemory | None = None
        self.server: TcpBlockServer | None = None
        self.puller: TcpPuller | None = None
        self.fingerprint = ""
        self._lookups: dict[str, _Lookup] = {}
        self._pulls: dict[str, _Pull] = {}
        self._to_start: list[PullJob] = []
        self._tried: set[str] = set()  # consumer requests that had their one pull (or refusal)
        self._params_out: dict[str, dict[str, Any]] = {}
        self._job_ids = itertools.count(1)
        self._counts = _Counts()
        self._load_bytes = 0
        self._load_time_s = 0.0
        # KV cache groups (bind_kv_cache_manager); per_group: several, or a sliding one.
        self.kvm: KVCacheManager | None = None
        self.group_specs: list[KVCacheSpec] = []
        self.per_group = False

    def bind_kv_cache_manager(self, kvm: KVCacheManager) -> None:
        """The engine's KV cache manager: its groups and their block tables."""
        self.kvm = kvm
        self.group_specs = [g.spec for g in kvm.kv_cache_groups]
        self.per_group = len(self.group_specs) > 1 or self.group_specs[0].sliding_window is not None

    def _group_lows(self, num_blocks: int, num_tokens: int) -> list[int]:
        """Per group, the first of ``num_blocks`` prompt blocks a hit of them needs (the hit
        point: ``min(num_blocks * bs, num_tokens - 1)``, as the consumer computes it): 0 for
        full attention, the window's first block for a sliding group."""
        bs = self.block_size
        hit = min(num_blocks * bs, num_tokens - 1)
        return [spec.num_skipped_blocks(hit, bs) for spec in self.group_specs]

    # ================================ worker side: setup =================================
    def register_kv_caches(self, kv_caches: torch.Tensor) -> None:
        self.memory = BlockMemory(kv_caches)
        layout = ChunkLayout.from_kv_cache(kv_caches, 1)
        # Weights (sampled content), hash seed and KV layout (and the KV cache groups: a block
        # holds one group's layers): peers share KV only when equal.
        groups = []
        if self.per_group and self.kvm is not None:
            groups = [kv_groups_identity(self.kvm.kv_cache_groups)]
        self.fingerprint = fingerprint_model_dir(
            self.config.model or "", self.config.prefix_hash_seed, layout.describe(), *groups
        )
        cfg = self.config
        if self.is_producer:
            assert self.leases is not None
            self.server = TcpBlockServer(
                self.memory,
                self.leases,
                self.fingerprint,
                host=cfg.kv_transfer_host,
                port=cfg.kv_transfer_port,
                timeout=cfg.kv_transfer_timeout,
            )
        if self.is_consumer:
            self.puller = TcpPuller(
                self.memory, self.fingerprint, timeout=cfg.kv_transfer_timeout, wakeup=self.wakeup
            )

    # ================================ scheduler side =====================================
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
        n, _ = self._usable(request, remote)
        end = min(n * self.block_size, request.num_tokens - 1)
        num_external = end - num_computed_tokens
        if num_external <= 0:
            return 0, False
        self._lookups[rid] = _Lookup(remote, num_computed_tokens)
        return num_external, True

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        lookup = self._lookups.pop(rid, None)
        if not self.is_consumer or rid in self._tried:
            return
        remote = pdp.parse_remote_prefill(request.kv_transfer_params)
        if remote is None:
            if pdp.wants_remote_prefill(request.kv_transfer_params):
                self._tried.add(rid)
                self._counts.refused += 1
                logger.warning(
                    "request %s: kv_transfer_params lack kvserve's transport fields; "
                    "prefilling locally", rid,
                )  # fmt: skip
            return
        self._tried.add(rid)
        if num_external_tokens <= 0 or lookup is None:
            _, why = self._usable(request, remote)
            if why:
                self._counts.refused += 1
                logger.warning("request %s: remote KV refused (%s); prefilling locally", rid, why)
            self._release_remote(rid, remote)  # nothing to pull: free the producer's blocks
            return
        bs = self.block_size
        start = lookup.num_computed_tokens // bs
        end = -(-(lookup.num_computed_tokens + num_external_tokens) // bs)
        if self.per_group:
            job = self._group_job(request, remote, lookup.num_computed_tokens, num_external_tokens)
        else:
            job = PullJob(
                job_id=next(self._job_ids),
                req_id=rid,
                host=remote.host,
                port=remote.port,
                lease_id=remote.lease_id,
                start=start,
                end=end,
                dst_block_ids=list(block_ids[start:end]),
                expected_hashes=list(request.block_hashes[start:end]),
            )
        self._to_start.append(job)
        self._pulls[rid] = _Pull(job)
        self._counts.pulls += 1

    def _usable(self, request: Request, remote: pdp.RemotePrefill) -> tuple[int, str]:
        """How many remote prompt blocks ``request`` can load (all or none) and why not: with
        KV cache groups, each group's remote blocks must cover what a hit there needs."""
        n, why = remote.usable_blocks(request.block_hashes, self.fingerprint, self.block_size)
        if not n:
            return n, why
        groups = remote.group_block_ids
        if not self.per_group:
            return (0, "the remote KV is per KV cache group, ours is not") if groups else (n, "")
        if groups is None or len(groups) != len(self.group_specs):
            return 0, "the remote KV cache groups are not ours"
        lows = self._group_lows(n, request.num_tokens)
        if any(low < n - len(g) for low, g in zip(lows, groups, strict=True)):
            return 0, "a remote sliding window does not cover this prompt's"
        return n, ""

    def _group_job(
        self, request: Request, remote: pdp.RemotePrefill, num_computed: int, num_external: int
    ) -> PullJob:
        """One pull of every group's blocks a hit at ``num_computed + num_external`` tokens
        needs past the request's own ``num_computed`` (a sliding group: only its window), into
        the blocks the scheduler allocated for each group; ``ranges`` index the producer's
        lease, its groups' blocks back to back."""
        assert self.kvm is not None and remote.group_block_ids is not None
        bs = self.block_size
        hit = num_computed + num_external
        end = -(-hit // bs)
        n = remote.num_blocks
        tables = self.kvm.get_group_block_ids(request.request_id)
        ranges: list[tuple[int, int]] = []
        dst: list[int] = []
        hashes: list[bytes] = []
        offset = 0  # the group's first index in the lease
        for spec, table, theirs in zip(
            self.group_specs, tables, remote.group_block_ids, strict=True
        ):
            lo = max(num_computed // bs, spec.num_skipped_blocks(hit, bs))
            first = n - len(theirs)  # the prompt block of the group's first leased block
            if end > lo:
                ranges.append((offset + lo - first, offset + end - first))
                dst.extend(table[lo:end])
                hashes.extend(request.block_hashes[lo:end])
            offset += len(theirs)
        return PullJob(
            job_id=next(self._job_ids),
            req_id=request.request_id,
            host=remote.host,
            port=remote.port,
            lease_id=remote.lease_id,
            start=num_computed // bs,
            end=end,
            dst_block_ids=dst,
            expected_hashes=hashes,
            ranges=ranges,
        )

    def _release_remote(self, rid: str, remote: pdp.RemotePrefill) -> None:
        """Tell the producer its lease is not needed (fire and forget)."""
        if remote.num_blocks:
            self._send_release(rid, remote.host, remote.port, remote.lease_id)

    def _send_release(self, rid: str, host: str, port: int, lease_id: str) -> None:
        if self.puller is None:
            return
        self._counts.releases += 1
        self.puller.submit(PullJob(next(self._job_ids), rid, host, port, lease_id, 0, 0, [], []))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDConnectorMetadata:
        meta = PDConnectorMetadata(pulls=self._to_start)
        self._to_start = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        rid = request.request_id
        self._lookups.pop(rid, None)
        params = request.kv_transfer_params
        # Consumer: stop a pull in flight; the blocks stay held until its thread lets go.
        pull = self._pulls.get(rid)
        if pull is not None:
            self._tried.discard(rid)
            if pull.job in self._to_start:  # not handed to the puller yet
                self._to_start.remove(pull.job)
                del self._pulls[rid]
                job = pull.job
                self._send_release(rid, job.host, job.port, job.lease_id)
                return False
            pull.finished = True
            assert self.puller is not None
            self.puller.cancel(pull.job)
            return True
        if rid in self._tried:
            self._tried.discard(rid)
        elif self.is_consumer and pdp.wants_remote_prefill(params):
            remote = pdp.parse_remote_prefill(params)
            if remote is not None:  # ended before it was ever allocated
                self._release_remote(rid, remote)
        # Producer: hold the full prompt blocks under a lease for the decode leg.
        if not (self.is_producer and pdp.wants_remote_decode(params)):
            return False
        if request.status not in _LEASABLE or self.server is None:
            return False
        assert self.leases is not None
        bs = self.block_size
        n = pdp.offered_blocks(request, block_ids, bs)
        offered: list[int] | list[list[int]] = block_ids[:n]
        leased, hashes = block_ids[:n], request.block_hashes[:n]
        if self.per_group and n:
            offered, leased, hashes = self._group_lease(request, n)
            if not leased:
                n, offered = 0, []
        lease_id = ""
        if n:
            lease = self.leases.add(rid, leased, hashes)
            self.server.seal(lease)
            lease_id = lease.lease_id
        host, port = self.server.address
        self._params_out[rid] = pdp.decode_leg_params(
            engine_id=self.engine_id,
            host=host,
            port=port,
            lease_id=lease_id or "none",
            block_ids=offered,
            block_size=bs,
            fingerprint=self.fingerprint,
            last_block_hash=request.block_hashes[n - 1] if n else None,
            num_blocks=n,
        )
        return n > 0

    def _group_lease(
        self, request: Request, n: int
    ) -> tuple[list[list[int]], list[int], list[bytes]]:
        """Per group, the blocks of ``n`` offered prompt blocks a hit at their end needs (a
        sliding group: its window); the lease's blocks (the groups' back to back) and their
        chain hashes. Nothing when a needed block was freed already (a window that moved on)."""
        assert self.kvm is not None
        null = self.kvm.block_pool.null_block.block_id
        tables = self.kvm.get_group_block_ids(request.request_id)
        lows = self._group_lows(n, request.num_prompt_tokens)
        per_group = [table[lo:n] for table, lo in zip(tables, lows, strict=True)]
        if any(len(g) != n - lo or null in g for g, lo in zip(per_group, lows, strict=True)):
            return [], [], []
        leased = [b for g in per_group for b in g]
        hashes = [h for lo in lows for h in request.block_hashes[lo:n]]
        return per_group, leased, hashes

    def get_finished_kv_transfer_params(self, request: Request) -> dict[str, Any] | None:
        return self._params_out.pop(request.request_id, None)

    def stats(self) -> KVConnectorStats:
        c = self._counts
        extra: dict[str, float] = {}
        if self.is_consumer:
            extra.update(
                pd_pulls=c.pulls, pd_pulls_ok=c.pulls_ok, pd_pulls_failed=c.pulls_failed,
                pd_blocks_pulled=c.blocks_pulled, pd_blocks_invalid=c.blocks_invalid,
                pd_refused=c.refused, pd_releases_sent=c.releases, pd_pull_cpu_s=c.pull_cpu_s,
                pd_pulls_inflight=self.puller.num_inflight if self.puller else 0,
            )  # fmt: skip
        if self.leases is not None:
            lc = self.leases.counts
            extra.update(
                pd_leases_created=lc.created, pd_leases_pulled=lc.pulled,
                pd_leases_expired=lc.expired, pd_leases_active=self.leases.num_active,
                pd_blocks_leased=self.leases.num_blocks_held(),
            )  # fmt: skip
        if self.server is not None:
            sc = self.server.counts
            extra.update(
                pd_pulls_served=sc.pulls, pd_pulls_served_ok=sc.pulls_ok,
                pd_pulls_served_failed=sc.pulls_failed, pd_blocks_sent=sc.blocks_sent,
                pd_bytes_sent=sc.bytes_sent, pd_send_time_s=sc.send_time_s,
                pd_serve_cpu_s=sc.cpu_time_s,
            )  # fmt: skip
        return KVConnectorStats(
            load_bytes=self._load_bytes,
            load_time_s=self._load_time_s,
            extra={k: float(v) for k, v in extra.items()},
        )

    # ================================ worker side: per step ==============================
    def start_load_kv(self, metadata: PDConnectorMetadata | None) -> None:
        if metadata is None or self.puller is None:
            return
        for job in metadata.pulls:
            self.puller.submit(job)

    def wait_for_transfers(self, timeout: float) -> bool:
        busy = bool(self._pulls) or (self.leases is not None and self.leases.has_active())
        if not busy:
            return False
        self.wakeup.wait(timeout)
        return True

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        self.wakeup.clear()  # before draining: a later end sets it again
        out = KVConnectorOutput()
        if self.leases is not None:
            self.leases.expire()
            out.finished_sending.update(self.leases.take_released())
        if self.puller is None:
            return out
        for job in self.puller.poll():
            if job.release_only:
                continue
            pull = self._pulls.get(job.req_id)
            if pull is None or pull.job is not job:
                continue
            del self._pulls[job.req_id]
            self._account(job)
            if pull.finished:
                out.finished_sending.add(job.req_id)
                continue
            out.finished_recving.add(job.req_id)
            out.invalid_block_ids.update(job.dst_block_ids[job.good_blocks :])
        return out

    def _account(self, job: PullJob) -> None:
        c = self._counts
        c.blocks_pulled += job.good_blocks
        c.blocks_invalid += job.num_blocks - job.good_blocks
        self._load_bytes += job.nbytes
        self._load_time_s += job.seconds
        c.pull_cpu_s += job.cpu_seconds
        if job.good_blocks == job.num_blocks:
            c.pulls_ok += 1
            return
        c.pulls_failed += 1
        if not job.cancelled:
            logger.warning(
                "request %s: pulled %d of %d blocks from %s:%d (%s); recomputing the rest",
                job.req_id, job.good_blocks, job.num_blocks, job.host, job.port, job.error,
            )  # fmt: skip

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.puller is not None:
            self.puller.close()
            self.puller = None
        if self.leases is not None:
            self.leases.release_all()


def create_pd_connector(config: EngineConfig) -> KVConnectorBase:
    """``pd``, chained with offloading when a host tier is configured."""
    from kvserve.kv.multi_connector import chain_with_offload
    from kvserve.kv.offload.connector import OffloadingConnector

    return chain_with_offload(PDConnector(config), OffloadingConnector, config)


CONNECTORS["pd"] = create_pd_connector
