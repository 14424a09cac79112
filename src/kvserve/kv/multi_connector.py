"""A chain of KV connectors seen by the engine as one (e.g. P/D transfer, then offloading).

Loads: the connectors are asked in order; the first that provides tokens for a request (or is
still looking: ``None``) owns that request's load, the others are told they provide nothing.
Stores, events, touches and transfers: every connector does its own. A finished request's
blocks are held while any connector holds them, and released once every one that held them
reported it in ``finished_sending``. Outputs and stats are merged (``extra`` keys are
connector-specific and do not collide).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvserve.kv.connector import KVConnectorBase, KVConnectorOutput, KVConnectorStats

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.engine.kv_cache_manager import KVCacheManager
    from kvserve.engine.outputs import SchedulerOutput
    from kvserve.engine.request import Request
    from kvserve.kv.events import AnyKVEvent


class MultiConnector(KVConnectorBase):
    def __init__(self, connectors: list[KVConnectorBase]) -> None:
        if not connectors:
            raise ValueError("MultiConnector needs at least one connector")
        super().__init__(connectors[0].config)
        self.connectors = connectors
        self._owner: dict[str, int] = {}  # request id -> connector owning its pending load
        self._held: dict[str, set[int]] = {}  # finished request -> connectors holding it

    def bind_kv_cache_manager(self, kvm: KVCacheManager) -> None:
        """Hand the engine's KV cache manager (its groups) to every connector that takes it."""
        for c in self.connectors:
            bind = getattr(c, "bind_kv_cache_manager", None)
            if bind is not None:
                bind(kvm)

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        self._owner.pop(rid, None)
        for i, c in enumerate(self.connectors):
            n, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if n is None or n > 0:
                self._owner[rid] = i
                return n, load_async
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        owner = self._owner.pop(request.request_id, None)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(request, block_ids, num_external_tokens if i == owner else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> list[Any]:
        return [c.build_connector_meta(scheduler_output) for c in self.connectors]

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for c in self.connectors:
            c.update_connector_output(output)

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        rid = request.request_id
        self._owner.pop(rid, None)
        holders = {
            i for i, c in enumerate(self.connectors) if c.request_finished(request, block_ids)
        }
        if holders:
            self._held[rid] = holders
        return bool(holders)

    def check_kv_transfer_params(self, params: dict[str, Any]) -> None:
        for c in self.connectors:
            c.check_kv_transfer_params(params)

    def get_finished_kv_transfer_params(self, request: Request) -> dict[str, Any] | None:
        out: dict[str, Any] | None = None
        for c in self.connectors:
            p = c.get_finished_kv_transfer_params(request)
            if p is not None and out is None:
                out = p
        return out

    def take_events(self) -> list[AnyKVEvent]:
        events: list[AnyKVEvent] = []
        for c in self.connectors:
            events.extend(c.take_events())
        return events

    def has_pending_work(self) -> bool:
        return any(c.has_pending_work() for c in self.connectors)

    def touch(self, block_hashes: list[bytes]) -> None:
        for c in self.connectors:
            c.touch(block_hashes)

    def stats(self) -> KVConnectorStats:
        out = KVConnectorStats()
        for c in self.connectors:
            s = c.stats()
            out.lookups += s.lookups
            out.lookup_hit_tokens += s.lookup_hit_tokens
            out.lookup_query_tokens += s.lookup_query_tokens
            out.load_bytes += s.load_bytes
            out.load_time_s += s.load_time_s
            out.store_bytes += s.store_bytes
            out.store_time_s += s.store_time_s
            out.allocation_failures += s.allocation_failures
            out.extra.update(s.extra)
            out.tiers.update(s.tiers)
        return out

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: torch.Tensor) -> None:
        for c in self.connectors:
            c.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: list[Any] | None) -> None:
        for c, m in zip(self.connectors, metadata or [None] * len(self.connectors), strict=True):
            c.start_load_kv(m)

    def wait_for_save(self, metadata: list[Any] | None) -> None:
        for c, m in zip(self.connectors, metadata or [None] * len(self.connectors), strict=True):
            c.wait_for_save(m)

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        for c in self.connectors:
            c.handle_preemptions(preempted_req_ids)

    def wait_for_transfers(self, timeout: float) -> bool:
        """Each connector with transfers in flight waits its share of ``timeout``: one that
        has none returns at once, so a single busy connector gets most of it."""
        share = timeout / len(self.connectors)
        waited = False
        for c in self.connectors:
            waited = c.wait_for_transfers(share) or waited
        return waited

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for i, c in enumerate(self.connectors):
            co = c.get_finished(finished_req_ids)
            out.finished_recving |= co.finished_recving
            out.invalid_block_ids |= co.invalid_block_ids
            for rid in co.finished_sending:
                holders = self._held.get(rid)
                if holders is None:
                    out.finished_sending.add(rid)
                    continue
                holders.discard(i)
                if not holders:
                    del self._held[rid]
                    out.finished_sending.add(rid)
        return out

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()


def chain_with_offload(
    first: KVConnectorBase, offload: Callable[[EngineConfig], KVConnectorBase], config: EngineConfig
) -> KVConnectorBase:
    """``first`` alone, or chained before an offloading connector when a host tier is
    configured (``kv_offload_size > 0``)."""
    if config.kv_offload_size <= 0:
        return first
    return MultiConnector([first, offload(config)])
