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

from kvserve.engine.core_client import EngineClient
from kvserve.server.errors import APIError, bad_request

RETRY_AFTER_S = 1


class Ticket:
    """Room held for one request's sequences until each is handed to the engine."""

    def __init__(self, control: AdmissionControl, num_seqs: int) -> None:
        self.control = control
        self.held = num_seqs

    def hand_over(self, num_seqs: int = 1) -> None:
        """``num_seqs`` sequences are about to be added to the engine (which counts them from
        then on): stop holding room for them."""
        n = min(num_seqs, self.held)
        self.held -= n
        self.control.admitting -= n


class AdmissionControl:
    def __init__(self, engine: EngineClient, max_running: int, max_waiting: int) -> None:
        self.engine = engine
        self.capacity = max_running + max(0, max_waiting)
        self.admitting = 0  # sequences of requests admitted, not yet added to the engine
        self.num_rejected = 0

    @property
    def num_pending(self) -> int:
        return self.engine.num_inflight + self.admitting

    @contextmanager
    def admit(self, num_seqs: int) -> Iterator[Ticket]:
        """Hold room for ``num_seqs`` sequences until they are handed over or the block ends;
        429 when there is none."""
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
        ticket = Ticket(self, num_seqs)
        try:
            yield ticket
        finally:
            ticket.hand_over(ticket.held)
