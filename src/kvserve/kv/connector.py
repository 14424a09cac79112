"""The KV connector interface: how the engine reaches KV outside its primary pool.

A connector has two halves that talk only through per-step metadata and worker output:

- scheduler side (owns decisions, runs in the scheduler): how many tokens beyond the primary
  pool's prefix hit it can provide, whether that load is asynchronous, what to load and store
  this step, and whether a finished request's blocks must be held until a store completes;
- worker side (owns transfers, runs next to the KV tensors): starts loads and stores and
  reports which requests' transfers finished.

Implementations (offloading to tiers, P/D transfer) register by name in :data:`CONNECTORS`
and are selected with ``EngineConfig.kv_connector``. A connector must never fail a request:
a failed load is reported through ``invalid_block_ids`` and the request recomputes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.engine.outputs import SchedulerOutput
    from kvserve.engine.request import Request
    from kvserve.kv.events import AnyKVEvent


@dataclass
class KVConnectorOutput:
    """Worker -> scheduler report of one step."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


# A step's report when nothing finished: shared, read-only (frozensets: an update fails loudly).
NO_TRANSFERS = KVConnectorOutput(frozenset(), frozenset(), frozenset())  # type: ignore[arg-type]


@dataclass
class KVConnectorStats:
    """Counters a connector exposes for metrics (monotonic totals)."""

    lookups: int = 0
    lookup_hit_tokens: int = 0
    lookup_query_tokens: int = 0
    load_bytes: int = 0
    load_time_s: float = 0.0
    store_bytes: int = 0
    store_time_s: float = 0.0
    allocation_failures: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    # Per storage tier (by tier id): TierStats counters plus usage_bytes / capacity_bytes.
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)


class KVConnectorBase(ABC):
    """Base class; one instance serves both sides in a single-process engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    # ---------------- scheduler side ----------------
    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` (the primary-pool hit) this connector can
        provide, and whether they arrive asynchronously (request waits in
        WAITING_FOR_REMOTE_KVS). Must respect "never recompute less than one token".
        ``None``: not known yet (a lookup in a slow tier runs): the scheduler leaves the
        request waiting, schedules the ones behind it, and asks again next step."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Called after the scheduler allocated ``block_ids`` (the full block table) for the
        request, ``num_external_tokens`` of which the connector is to fill."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """Per-step instructions for the worker side (loads to start, stores to issue)."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """Learn which transfers finished on the worker side."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """Request is done. True: the scheduler must keep ``block_ids`` allocated until the
        request id appears in ``finished_sending`` (an async store still reads them, a peer
        is still to pull them)."""
        return False

    def check_kv_transfer_params(self, params: dict[str, Any]) -> None:  # noqa: B027
        """Validate a request's ``kv_transfer_params`` at admission (ValueError: refused)."""

    def get_finished_kv_transfer_params(self, request: Request) -> dict[str, Any] | None:
        """After :meth:`request_finished`: the ``kv_transfer_params`` the finished request
        returns to its caller (P/D: where a decode engine pulls its KV from), or None."""
        return None

    def take_events(self) -> list[AnyKVEvent]:
        """KV events of the connector's tiers since the last call."""
        return []

    def has_pending_work(self) -> bool:
        """Transfers of the connector's own (not a request's) are in flight: the engine keeps
        stepping (and sleeping in :meth:`wait_for_transfers`) until they end."""
        return False

    def touch(self, block_hashes: list[bytes]) -> None:  # noqa: B027
        """Blocks that hit in the primary pool: keep them hot in lower tiers too."""

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats()

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: torch.Tensor) -> None:  # noqa: B027
        """The primary pool's KV tensor (layout in ``engine/attention``)."""

    def idle_step(self, metadata: Any) -> bool:
        """Whether this step's worker-side calls (:meth:`handle_preemptions`,
        :meth:`start_load_kv`, :meth:`wait_for_save`, :meth:`get_finished`) have nothing to do:
        nothing to start or store, nothing in flight. The engine then skips them (most decode
        steps of an offloading engine). Never, unless a connector says so."""
        return False

    def start_load_kv(self, metadata: Any) -> None:  # noqa: B027
        """Start this step's loads (before the forward pass)."""

    def wait_for_save(self, metadata: Any) -> None:  # noqa: B027
        """Issue this step's stores (after sampling; must not block on the copies)."""

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:  # noqa: B027
        """Blocks of these requests are about to be reused: finish or cancel their stores."""

    def wait_for_transfers(self, timeout: float) -> bool:
        """The engine has nothing to compute until a transfer ends: block (without holding the
        GIL) until one has ended, at most ``timeout`` seconds. Called right before
        :meth:`get_finished` of a step that scheduled no tokens. Returns False when no
        transfer was in flight (nothing to wait for)."""
        return False

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Transfers that completed since the last call (never blocks)."""
        return KVConnectorOutput()

    def shutdown(self) -> None:  # noqa: B027
        """Stop transfer workers, release memory."""


CONNECTORS: dict[str, Callable[[EngineConfig], KVConnectorBase]] = {}


def register_connector(name: str) -> Callable[[type[KVConnectorBase]], type[KVConnectorBase]]:
    def deco(cls: type[KVConnectorBase]) -> type[KVConnectorBase]:
        CONNECTORS[name] = cls
        return cls

    return deco


# Built-in connectors, imported on first use so that their registration runs.
BUILTIN_CONNECTORS = {"offload": "kvserve.kv.offload.connector", "pd": "kvserve.kv.pd.connector"}


def create_connector(config: EngineConfig) -> KVConnectorBase | None:
    name = config.kv_connector
    if not name:
        return None
    if name not in CONNECTORS and name in BUILTIN_CONNECTORS:
        import importlib

        importlib.import_module(BUILTIN_CONNECTORS[name])
    if name not in CONNECTORS:
        raise ValueError(f"unknown kv_connector {name!r}; known: {sorted(CONNECTORS)}")
    return CONNECTORS[name](config)
