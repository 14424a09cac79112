"""The engine-core process and its client: outputs equal to the in-process engine's, bad input,
aborts, the core's death, startup failures, dying with the parent, and `kvserve serve` on it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.core_client import EngineCoreClient
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from tests.server.conftest import engine_config, start_serve_process

PROMPTS: list[str | list[int]] = [
    "The quick brown fox jumps over the lazy dog because",
    [5, 6, 7, 8, 9, 10, 11],
    "Once upon a time there was",
]


def _config(model_dir: Path, **overrides) -> EngineConfig:
    return engine_config(model_dir, **{"max_num_seqs": 8, **overrides})


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


# Every asyncio.run below is bounded (wait_for): a stream left waiting fails, it does not hang.


def _wait(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path):
    client = EngineCoreClient(_config(tiny_model_dir))
    yield client
    client.shutdown()


def _params(i: int, stop: list[str] | None = None) -> SamplingParams:
    # Stop strings, logprobs and plain greedy: every field the deltas rebuild.
    if i == 0:
        return SamplingParams(max_tokens=24, temperature=0.0, stop=stop or [], logprobs=2)
    if i == 1:
        return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    return SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def test_outputs_equal_the_in_process_engine(core: EngineCoreClient, tiny_model_dir: Path):
    engine = LLMEngine(_config(tiny_model_dir))
    engine.add_request("probe", PROMPTS[0], _params(0))
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
    stop = [text[len(text) // 2 : len(text) // 2 + 2], "\x00never"]  # hit mid-stream
    params = [_params(0, stop), _params(1), _params(2)]
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params[i])
    want = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                want[out.request_id] = out

    async def consume(i: int, prompt):
        return [o async for o in core.generate(prompt, params[i], f"r{i}")]

    async def main():
        return await asyncio.gather(*(consume(i, p) for i, p in enumerate(PROMPTS)))

    for i, outs in enumerate(asyncio.run(asyncio.wait_for(main(), 120))):
        got, ref = outs[-1], want[f"r{i}"]
        assert got.finished and not any(o.finished for o in outs[:-1])
        g, r = got.outputs[0], ref.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            r.token_ids,
            r.text,
            r.finish_reason,
            r.stop_reason,
        )
        assert g.logprobs == r.logprobs and g.cumulative_logprob == r.cumulative_logprob
        assert got.prompt_token_ids == ref.prompt_token_ids and got.prompt == ref.prompt
        assert got.metrics.num_prompt_tokens == ref.metrics.num_prompt_tokens
        assert got.metrics.first_token_time is not None and got.metrics.finished_time is not None
        assert [t for o in outs for t in o.new_token_ids] == g.token_ids
        assert "".join(o.new_text for o in outs) == g.text
    assert want["r0"].outputs[0].finish_reason == "stop"  # the stop-string path ran
    assert core.num_inflight == 0


def test_bad_input_duplicates_and_aborts(core: EngineCoreClient):
    async def main():
        with pytest.raises(ValueError, match="maximum context length"):
            await core.add_request("bad", list(range(1, 300)), SamplingParams(max_tokens=1))
        with pytest.raises(ValueError, match="empty"):
            await core.add_request("bad", [], SamplingParams(max_tokens=1))
        long = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
        stream = await core.add_request("dup", PROMPTS[0], long)
        with pytest.raises(KeyError):
            await core.add_request("dup", PROMPTS[1], SamplingParams(max_tokens=2))
        first = await stream.__anext__()
        await core.abort("dup")
        rest = [o async for o in stream]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert len(rest[-1].outputs[0].token_ids) >= len(first.outputs[0].token_ids)
        # The id is free again at once (the abort's late news must not end the new stream).
        outs = [o async for o in core.generate(PROMPTS[1], SamplingParams(max_tokens=2), "dup")]
        assert outs[-1].finished
        await core.abort("never-added")  # a no-op

    asyncio.run(asyncio.wait_for(main(), 120))
    assert core.is_alive


def test_a_cancelled_consumer_frees_its_blocks(core: EngineCoreClient):
    async def main():
        seen = asyncio.Event()

        async def consume():
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            async for out in core.generate(PROMPTS[2], params, "cancel-me"):
                if len(out.outputs[0].token_ids) >= 2:
                    seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(seen.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(main(), 120))
    _wait(lambda: core.num_inflight == 0)
    _wait(lambda: core.stats().num_running == 0 and core.stats().kv_cache_usage == 0.0)
    steps = core.num_steps
    time.sleep(0.3)
    assert core.num_steps == steps  # idle: the core does not step


def test_a_dead_core_fails_requests_instead_of_hanging(tiny_model_dir: Path):
    client = EngineCoreClient(_config(tiny_model_dir))
    try:

        async def main():
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = await client.add_request("doomed", PROMPTS[0], params)
            await stream.__anext__()
            os.kill(client.pid, signal.SIGKILL)
            # At once, before anyone noticed: refused or failed, never left waiting (a
            # command socket without its peer must not block the event loop either).
            with pytest.raises(EngineDeadError):
                async with asyncio.timeout(20):
                    await client.add_request("racing", PROMPTS[1], params)
            with pytest.raises(EngineDeadError):
                async with asyncio.timeout(20):
                    async for _ in stream:
                        pass
            with pytest.raises(EngineDeadError):
                await client.add_request("late", PROMPTS[1], params)
            await client.abort("doomed")  # a no-op now, not a hang

        asyncio.run(asyncio.wait_for(main(), 120))
        assert not client.is_alive and client.num_inflight == 0
    finally:
        client.shutdown()


def test_a_core_that_cannot_start_says_why(tiny_model_dir: Path):
    with pytest.raises(RuntimeError, match="KV pool too small"):
        EngineCoreClient(_config(tiny_model_dir, num_kv_blocks=1))


def test_the_core_exits_with_its_parent(tiny_model_dir: Path):
    script = textwrap.dedent(
        f"""
        import os
        from kvserve.config import EngineConfig
        from kvserve.engine.core_client import EngineCoreClient
        c = EngineCoreClient(EngineConfig(model={str(tiny_model_dir)!r}, num_kv_blocks=64))
        print(c.pid, flush=True)
        os._exit(0)  # no shutdown: the parent just dies
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    pid = int(out.stdout.split()[0])
    _wait(lambda: not _alive(pid))


def test_serve_runs_the_engine_in_its_own_process(tiny_model_dir: Path):
    server = start_serve_process(tiny_model_dir, "--num-kv-blocks", "64")
    try:
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
        cores = [
            int(c)
            for c in children
            if b"kvserve.engine.core_process" in Path(f"/proc/{c}/cmdline").read_bytes()
        ]
        assert len(cores) == 1
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        os.kill(cores[0], signal.SIGKILL)
        _wait(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 503)
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "error" in r.json()
    finally:
        server.stop()
    assert server.proc.returncode is not None
