"""The EPP process's garbage collection runs between the loop's callbacks, not inside one."""

from __future__ import annotations

import asyncio
import gc
import weakref

from kvserve.cluster.epp.idle_gc import IdleCollector


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_collections_wait_for_the_loop_and_still_free_cycles():
    """A callback allocating ten thresholds' worth of containers is never interrupted by a
    collection (CPython's automatic collector would run ~10 in it); the cycles it left are
    freed by the collector's next ticks, which run the generations CPython would."""

    async def run() -> None:
        collector = IdleCollector(interval_s=0.005)
        collector.start()
        phases: list[str] = []

        def seen(phase: str, info: dict) -> None:
            phases.append(phase)

        gc.callbacks.append(seen)
        try:
            assert not gc.isenabled()
            threshold = gc.get_threshold()[0]
            garbage = [_Node() for _ in range(10 * threshold)]
            last = weakref.ref(garbage[-1])
            del garbage
            assert phases == []  # nothing collected while the callback ran
            assert last() is not None  # a cycle: reference counting cannot free it
            for _ in range(400):
                await asyncio.sleep(0.005)
                if last() is None:
                    break
            assert last() is None
            assert "start" in phases
            assert sum(collector.collections) >= 1
        finally:
            gc.callbacks.remove(seen)
            collector.stop()
        assert gc.isenabled()

    asyncio.run(run())


def test_a_due_generation_is_collected_as_cpython_would_pick_it():
    collector = IdleCollector()
    was = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        assert collector.collect_due() is None  # nothing allocated since: nothing due
        threshold = gc.get_threshold()[0]
        kept = [[] for _ in range(threshold + 10)]
        assert collector.collect_due() == 0
        assert gc.get_count()[0] < threshold
        for _ in range(gc.get_threshold()[1] + 1):  # enough young collections: the middle one
            kept += [[] for _ in range(threshold + 10)]
            gc.collect(0)
        kept += [[] for _ in range(threshold + 10)]
        assert collector.collect_due() == 1
        assert collector.collections[:2] == [1, 1]
    finally:
        if was:
            gc.enable()


def test_reads_collect_when_due_and_the_timer_sleeps_while_they_come():
    """The EPP transport's reads collect a due generation themselves (``after_read``); while
    they come, the timer ticks every ``fed_interval_s`` (here: not within the test), and
    without them at ``interval_s`` again."""

    async def run() -> None:
        collector = IdleCollector(interval_s=0.005, fed_interval_s=60.0)
        collector.start()
        try:
            threshold = gc.get_threshold()[0]
            await asyncio.sleep(0.03)  # a few ticks at 5 ms
            collector.after_read()
            await asyncio.sleep(0.03)  # the tick after the read: the next one in 60 s
            before = list(collector.collections)
            kept = [[] for _ in range(threshold + 10)]
            await asyncio.sleep(0.1)  # no tick: nothing collected
            assert collector.collections == before
            assert gc.get_count()[0] > threshold
            collector.after_read()  # a read: due, collected now
            assert sum(collector.collections) > sum(before)
            assert gc.get_count()[0] < threshold
            del kept
        finally:
            collector.stop()
        collector.after_read()  # stopped: nothing (CPython collects again)
        assert gc.isenabled()

    asyncio.run(run())
