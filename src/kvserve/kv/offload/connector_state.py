"""What the offloading connector keeps between calls: each step's instructions from the
scheduler side to the worker side (:class:`OffloadConnectorMetadata`), each request's state,
each transfer job's record, and lookups waiting for the request's allocation. Plain data: the
logic that updates them lives in the connector's modules (``scheduler_side``, ``worker_side``,
``group_stage``, ``storage_tiers``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.kv.offload.storage_worker import ReadItem
from kvserve.kv.offload.worker import TransferJob

if TYPE_CHECKING:
    from kvserve.engine.request import Request


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
class RequestState:
    request: Request
    next_store_chunk: int = 0  # chunks below were stored, already held, or rejected
    load_job: int | None = None
    store_jobs: set[int] = field(default_factory=set)
    finished: bool = False  # request_finished() was called; waiting for jobs to end
    # Step at which build_connector_meta next looks at this request: the step its next chunk
    # fills if it computes one token per step (requests computing more are found apart).
    due: int = 0


@dataclass
class JobRecord:
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
class LookupResult:
    num_computed_tokens: int
    num_external_tokens: int
    tier_sources: list[int] = field(default_factory=list)  # storage tier of each chunk past
    cpu_chunks: int = 0  # the host tier's hits (chunks), which come first


@dataclass
class TierLookup:
    """A storage-tier lookup of a waiting request's chunks from chunk ``first`` on."""

    op_id: int
    first: int
    started: float
    sources: list[int] | None = None  # None while in flight
