"""AsyncEngine: the engine thread, streaming, cancellation, failures, step listeners."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq

from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.event_publisher import ZmqEventPublisher
from kvserve.kv.events import BlockStored, decode_batch
from kvserve.server.cli import kv_event_listener

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "Once upon a time there was",
    "In the beginning",
]


def _engine_config(model_dir: Path, **overrides):
    from kvserve.config import EngineConfig

    kw = dict(model=str(model_dir), num_kv_blocks=64, max_model_len=256, max_num_seqs=8)
    kw.update(overrides)
    return EngineConfig(**kw)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _run_sync(engine: LLMEngine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"sync-{i}", p, _greedy(max_tokens))
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    return [final[f"sync-{i}"] for i in range(len(prompts))]


async def _wait_idle(aeng: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = aeng.stats()
        if (
            not aeng.engine.has_unfinished_requests()
            and aeng.num_inflight == 0
            and s.num_running == 0
            and s.kv_cache_usage == 0.0
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {aeng.stats()}")


@pytest.fixture(scope="module")
def aengine(tiny_model_dir: Path):
    aeng = AsyncEngine(LLMEngine(_engine_config(tiny_model_dir)))
    yield aeng
    aeng.shutdown()


def test_streams_match_the_synchronous_engine(aengine: AsyncEngine):
    expected = _run_sync(aengine.engine, PROMPTS, 10)  # before the thread owns the engine
    aengine.start()

    async def consume(i: int, prompt: str):
        outs = [o async for o in aengine.generate(prompt, _greedy(10), f"async-{i}")]
        return outs

    async def main():
        return await asyncio.gather(*(consume(i, p) for i, p in enumerate(PROMPTS)))

    results = asyncio.run(main())
    for outs, want in zip(results, expected, strict=True):
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        assert final.outputs[0].token_ids == want
        # Deltas (merged when several steps queued up) add up to the cumulative output.
        assert [t for o in outs for t in o.new_token_ids] == want
        assert "".join(o.new_text for o in outs) == final.outputs[0].text
    assert aengine.num_inflight == 0


def test_idle_engine_thread_sleeps(aengine: AsyncEngine):
    aengine.start()

    async def one():
        return [o async for o in aengine.generate(PROMPTS[0], _greedy(3), "idle-check")]

    asyncio.run(one())
    time.sleep(0.1)  # the step that retires the finished request may still be running
    steps = aengine.num_steps
    time.sleep(0.3)
    assert aengine.num_steps == steps  # no stepping without work
    assert aengine.is_alive


def test_cancelled_consumer_aborts_and_frees_blocks(aengine: AsyncEngine):
    aengine.start()

    async def main():
        seen = asyncio.Event()

        async def consume():
            async for out in aengine.generate(PROMPTS[0] * 3, _greedy(200), "to-cancel"):
                if len(out.outputs[0].token_ids) >= 2:
                    seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(seen.wait(), 30)
        assert aengine.stats().kv_cache_usage > 0 or aengine.engine.has_unfinished_requests()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_idle(aengine)

    asyncio.run(main())
    aengine.engine.check_integrity()


def test_bad_request_raises_and_engine_keeps_serving(aengine: AsyncEngine):
    aengine.start()

    async def main():
        too_long = list(range(1, 300))
        with pytest.raises(ValueError, match="maximum context length"):
            await aengine.add_request("bad", too_long, _greedy(1))
        with pytest.raises(ValueError):
            async for _ in aengine.generate([], _greedy(1), "empty"):
                pass
        # Long enough to still run when the duplicate comes (a 2-token request could finish
        # first on a fast engine), then aborted.
        stream = await aengine.add_request("dup", PROMPTS[1], _greedy(150))
        with pytest.raises(KeyError):
            await aengine.add_request("dup", PROMPTS[1], _greedy(2))
        await aengine.abort("dup")
        outs = [o async for o in stream]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert len(outs[-1].outputs[0].token_ids) < 150
        # The id is free again once finished.
        outs = [o async for o in aengine.generate(PROMPTS[1], _greedy(2), "dup")]
        assert outs[-1].finished

    asyncio.run(main())
    assert aengine.is_alive


def test_abort_by_id_ends_the_stream(aengine: AsyncEngine):
    aengine.start()

    async def main():
        stream = await aengine.add_request("abort-me", PROMPTS[2], _greedy(200))
        first = await stream.__anext__()
        assert not first.finished
        await aengine.abort("abort-me")
        # The stream ends with the aborted request's final output (it used to stay open).
        rest = [o async for o in stream]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert rest[-1].outputs[0].token_ids[: len(first.outputs[0].token_ids)] == (
            first.outputs[0].token_ids
        )
        await _wait_idle(aengine)
        await aengine.abort("abort-me")  # unknown by now: a no-op

    asyncio.run(main())
    aengine.engine.check_integrity()


def test_step_listeners_run_and_a_failing_one_is_contained(aengine: AsyncEngine):
    aengine.start()
    seen: list[str] = []

    def failing(outputs):
        raise RuntimeError("listener bug")

    def recording(outputs):
        seen.extend(o.request_id for o in outputs)

    aengine.step_listeners[:] = [failing, recording]
    try:

        async def main():
            return [o async for o in aengine.generate(PROMPTS[0], _greedy(3), "listened")]

        outs = asyncio.run(main())
    finally:
        aengine.step_listeners.clear()
    assert outs[-1].finished and aengine.is_alive
    assert seen.count("listened") >= 1


def test_kv_event_listener_publishes_engine_events(tiny_model_dir: Path):
    engine = LLMEngine(_engine_config(tiny_model_dir, enable_kv_cache_events=True))
    aeng = AsyncEngine(engine)
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv@test@tiny")
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@test@tiny")
        sub.setsockopt(zmq.RCVTIMEO, 10_000)
        sub.connect(publisher.endpoint)
        time.sleep(0.3)  # let the subscription reach the publisher
        aeng.step_listeners.append(kv_event_listener(engine, publisher))
        aeng.start()
        prompt_ids = engine.tokenizer.encode(" ".join(PROMPTS * 2))
        assert len(prompt_ids) >= 33

        async def main():
            return [o async for o in aeng.generate(prompt_ids, _greedy(2), "events")]

        asyncio.run(main())
        stored: list[BlockStored] = []
        while sum(len(e.block_hashes) for e in stored) < 2:
            topic, _seq, payload = sub.recv_multipart()
            assert topic == b"kv@test@tiny"
            stored += [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
        tokens = [t for e in stored for t in e.token_ids]
        assert tokens[:32] == prompt_ids[:32]  # the prompt's first two full blocks
        assert all(e.block_size == 16 for e in stored)
    finally:
        sub.close(linger=0)
        aeng.shutdown()
        publisher.close()


def test_engine_loop_failure_fails_requests_instead_of_hanging(tiny_model_dir: Path):
    engine = LLMEngine(_engine_config(tiny_model_dir))
    aeng = AsyncEngine(engine)
    aeng.start()
    real_execute = engine.runner.execute_model
    calls = 0

    def failing_execute(scheduler_output):  # fault injection: the 3rd forward pass fails
        nonlocal calls
        calls += 1
        if calls >= 3:
            raise RuntimeError("device lost")
        return real_execute(scheduler_output)

    engine.runner.execute_model = failing_execute

    async def main():
        outs = []
        with pytest.raises(EngineDeadError, match="device lost"):
            async for out in aeng.generate(PROMPTS[0], _greedy(50), "doomed"):
                outs.append(out)
        assert outs and not outs[-1].finished
        with pytest.raises(EngineDeadError):
            await aeng.add_request("after", PROMPTS[0], _greedy(2))

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert not aeng.is_alive and isinstance(aeng.error, RuntimeError)
    finally:
        aeng.shutdown()
