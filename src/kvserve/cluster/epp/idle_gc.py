"""Python's cyclic garbage collector, run between the event loop's callbacks.

Owns when the EPP process collects. CPython collects when a generation's allocation count
passes its threshold, i.e. inside whatever allocates: in this process that is a request's
handler, so every young-generation collection (0.2-0.7 ms here, 1-2 ms for the middle one)
lands on some request's critical path (a diagnostic run at 200 req/s: 24% of the slowest 1% of
requests through the EPP overlapped a collection, 4% of all). With :class:`IdleCollector` the
automatic collector is off and a timer of the loop runs the same collections (the same
thresholds, generation by generation, as CPython would) between callbacks: a collection then
delays only the messages that arrive while it runs.

Garbage without cycles is freed by reference counting as always; only cyclic garbage waits
for the next tick (``interval_s``).

The EPP's transport also checks after a read of Envoy's connections that leaves no ext_proc
call open (:meth:`after_read`, that read's answers written: no request waits on the EPP or on
Envoy's next message, as a collection right after any read would often make one wait): while
such reads come, collections happen there and the timer ticks every ``fed_interval_s``
instead. A tick is a wake-up of its own: every 20 ms they cost the idle process ~11 ms of CPU
a second on machine C (13.3-14.7 vs 2.7-3.3 ms/s with a 1 s tick), ~0.05 ms per request at
200 req/s.
"""

from __future__ import annotations

import asyncio
import gc


class IdleCollector:
    """Automatic collection off; every ``interval_s`` the loop collects the oldest
    generation whose count passed its threshold (``gc.get_threshold()``), as CPython would
    have at an allocation. :meth:`stop` gives the collection back to CPython."""

    def __init__(self, interval_s: float = 0.02, fed_interval_s: float = 0.25) -> None:
        if interval_s <= 0 or fed_interval_s <= 0:
            raise ValueError("interval_s and fed_interval_s must be positive")
        self.interval_s = interval_s
        self.fed_interval_s = fed_interval_s  # the tick while after_read is called
        self.collections = [0, 0, 0]  # run by this collector, per generation
        self._timer: asyncio.TimerHandle | None = None
        self._was_enabled = True
        self._fed = False  # after_read was called since the last tick

    def start(self) -> None:
        """In the loop's thread: from now on collections happen between its callbacks."""
        if self._timer is not None:
            return
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._tick)

    def stop(self) -> None:
        if self._timer is None:
            return
        self._timer.cancel()
        self._timer = None
        if self._was_enabled:
            gc.enable()

    def collect_due(self) -> int | None:
        """Collect the generation that is due, if any; returns it (None: nothing due)."""
        counts, thresholds = gc.get_count(), gc.get_threshold()
        if not thresholds[0] or counts[0] <= thresholds[0]:  # (0: collection off)
            return None
        gen = 2 if counts[2] > thresholds[2] else 1 if counts[1] > thresholds[1] else 0
        gc.collect(gen)
        self.collections[gen] += 1
        return gen

    def after_read(self) -> None:
        """A quiet moment (the EPP transport's read that left no call open, its answers
        written): collect now if a generation is due; the timer sleeps longer while these
        come."""
        if self._timer is not None:
            self._fed = True
            self.collect_due()

    def _tick(self) -> None:
        try:
            self.collect_due()
        finally:
            if self._timer is not None:
                delay = self.fed_interval_s if self._fed else self.interval_s
                self._fed = False
                self._timer = asyncio.get_running_loop().call_later(delay, self._tick)
