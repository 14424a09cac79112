"""Admission control of the engine server: a bounded queue in front of the engine.

The engine runs up to ``max_num_seqs`` sequences; the rest wait in its scheduler. Without a
bound, a burst queues without limit and every request's latency grows with it (a collapse,
not a slowdown). Here a request whose sequences would take the engine past
``max_num_seqs + max_waiting_requests`` is refused at once with 429 and ``Retry-After``, before
any tokenization, so clients and routers back off or go elsewhere. The count is the engine's
requests in flight plus those being admitted (tokenized, not yet added); a request asking for
more sequences than the whole capacity can never run and gets 400.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvserve.engine.async_engine import AsyncEngine
from kvserve.server.errors import APIError, bad_request

RETRY_AFTER_S = 1


class AdmissionControl:
    def __init__(self, engine: AsyncEngine, max_running: int, max_waiting: int) -> None:
        self.engine = engine
        self.capacity = max_running + max(0, max_waiting)
        self.admitting = 0  # sequences of requests between admission and the engine
        self.num_rejected = 0

    @property
    def num_pending(self) -> int:
        return self.engine.num_inflight + self.admitting

    @contextmanager
    def admit(self, num_seqs: int) -> Iterator[None]:
        """Hold room for ``num_seqs`` sequences until the engine has them (or the block ends)."""
        if num_seqs > self.capacity:
            raise bad_request(
                f"The request asks for {num_seqs} sequences; this server holds at most "
                f"{self.capacity} at once.",
                "n",
                "too_many_sequences",
            )
        pending = self.num_pending
        if pending + num_seqs > self.capacity:
            self.num_rejected += 1
            raise APIError(
                f"The engine is overloaded: {pending} sequences running or waiting (at most "
                f"{self.capacity}). Retry after {RETRY_AFTER_S} s.",
                429,
                code="engine_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.admitting += num_seqs
        try:
            yield
        finally:
            self.admitting -= num_seqs
