"""What a P/D transport is: the seam where RDMA (NIXL) or Mooncake can sit next to TCP.

A transport has two halves, both off the engine thread:

- a :class:`LeaseServer` on the producer serves the blocks of its leases to pulls (and seals
  each new lease: digests of its blocks, so what arrives is verified against what was computed);
- a :class:`Puller` on the consumer runs :class:`PullJob` s in the background, writing straight
  into the destination blocks, and reports each job once it no longer touches them.

The connector owns the decisions (which blocks, what a failure means); a transport only moves
and verifies bytes. A job's outcome is ``good_blocks``: how many leading blocks arrived intact
and match the consumer's chain hashes; every block after them is recomputed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvserve.engine.hashing import BlockHash
from kvserve.kv.pd.leases import Lease


@dataclass(eq=False)
class PullJob:
    """Pull lease blocks ``[start, end)`` (or the index ``ranges`` of the lease, in order: the
    blocks of several KV cache groups) into ``dst_block_ids`` (one per index)."""

    job_id: int
    req_id: str
    host: str
    port: int
    lease_id: str
    start: int
    end: int
    dst_block_ids: list[int]
    expected_hashes: list[BlockHash]  # the consumer's chain hashes of those blocks
    ranges: list[tuple[int, int]] | None = None  # None: [(start, end)]
    # Outcome, set by the transport before the job is reported.
    good_blocks: int = 0
    error: str | None = None
    nbytes: int = 0  # bytes received into verified blocks
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # CPU time of the thread that ran it
    cancelled: bool = False

    @property
    def num_blocks(self) -> int:
        if self.ranges is not None:
            return sum(b - a for a, b in self.ranges)
        return self.end - self.start

    @property
    def release_only(self) -> bool:
        """Pulls nothing: tells the producer its lease is not needed."""
        return self.num_blocks == 0


class LeaseServer(ABC):
    """Producer half."""

    @property
    @abstractmethod
    def address(self) -> tuple[str, int]:
        """(host, port) a consumer reaches this server at."""

    @abstractmethod
    def seal(self, lease: Lease) -> None:
        """A new lease: digest its blocks (asynchronously; pulls wait for it)."""

    @abstractmethod
    def close(self) -> None: ...


class Puller(ABC):
    """Consumer half."""

    @abstractmethod
    def submit(self, job: PullJob) -> None: ...

    @abstractmethod
    def cancel(self, job: PullJob) -> None:
        """Stop the job soon (it is still reported, once it no longer writes its blocks)."""

    @abstractmethod
    def poll(self) -> list[PullJob]:
        """Jobs that ended since the last call (never blocks)."""

    @property
    @abstractmethod
    def num_inflight(self) -> int: ...

    @abstractmethod
    def close(self) -> None: ...
