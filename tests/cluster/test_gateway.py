"""The router's HTTP gateway against real local OpenAI-shaped servers: proxying, streaming
pass-through, failover before the first byte, health out/in, client disconnect, routing by
real KV events, endpoint file reloads, metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvserve.cluster.config import router_config_from_dict
from kvserve.cluster.gateway import Router
from kvserve.cluster.headers import ENDPOINT_HEADER
from kvserve.kv.event_publisher import ZmqEventPublisher
from kvserve.kv.events import AllBlocksCleared, BlockStored

from .fake_openai_backend import FakeBackend

BS = 16
PROMPT = list(range(100, 100 + 6 * BS + 3))  # 6 cacheable blocks


def arun(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), 60))


async def start_router(endpoints: list[Any], **overrides: Any) -> Router:
    cfg: dict[str, Any] = {
        "endpoints": endpoints,
        "health": {"interval_s": 0.1, "timeout_s": 0.5, "metrics_interval_s": 0.1},
        "scheduler": {"picker": {"name": "round_robin"}},
        "endpoints_file_poll_s": 0.05,
    }
    cfg.update(overrides)
    router = Router(router_config_from_dict(cfg))
    await router.start(host="127.0.0.1", port=0)
    return router


async def until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def post(
    s: aiohttp.ClientSession, router: Router, body: dict, path: str = "/v1/completions", **kw
) -> tuple[int, Any, str | None]:
    async with s.post(f"http://127.0.0.1:{router.port}{path}", json=body, **kw) as r:
        data = await r.json(content_type=None)
        return r.status, data, r.headers.get(ENDPOINT_HEADER)


async def stop_all(router: Router, *backends: FakeBackend) -> None:
    await router.stop()
    for b in backends:
        await b.stop()


def test_proxy_models_errors_health_and_metrics() -> None:
    async def main() -> None:
        a = await FakeBackend("a", model="m1").start()
        b = await FakeBackend("b", model="m2").start()
        router = await start_router([a.url, b.url])
        try:
            async with aiohttp.ClientSession() as s:
                base = f"http://127.0.0.1:{router.port}"
                async with s.get(base + "/v1/models") as r:
                    assert {m["id"] for m in (await r.json())["data"]} == {"m1", "m2"}
                body = {"model": "m2", "prompt": "hello", "max_tokens": 3, "extra_field": [1]}
                status, data, served = await post(s, router, body, headers={"X-Trace": "t1"})
                assert status == 200 and served == b.url and data["choices"][0]["text"] == "from b"
                assert b.requests[-1] == body and b.headers[-1]["X-Trace"] == "t1"
                status, data, _ = await post(
                    s, router, {"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
                    path="/v1/chat/completions",
                )  # fmt: skip
                assert status == 200 and data["model"] == "m1"
                status, data, _ = await post(s, router, {"model": "nope", "prompt": "x"})
                assert status == 404 and "nope" in data["error"]["message"]
                async with s.post(base + "/v1/completions", data=b"{not json") as r:
                    assert r.status == 400
                status, data, _ = await post(s, router, {"model": "m1"})
                assert status == 400 and "prompt" in data["error"]["message"]
                status, _, _ = await post(
                    s, router, {"model": "m1", "messages": "hi"}, "/v1/chat/completions"
                )
                assert status == 400
                async with s.get(base + "/health") as r:
                    assert r.status == 200 and (await r.json())["healthy_endpoints"] == 2
                async with s.get(base + "/version") as r:
                    assert (await r.json())["version"]
                async with s.get(base + "/v1/completions") as r:  # wrong method
                    assert r.status == 405 and "error" in await r.json()
                async with s.get(base + "/nope") as r:
                    assert r.status == 404 and "error" in await r.json()
                a.running, a.waiting, a.kv_usage = 3, 2, 0.5
                ep_a = router.pool.endpoints[a.url]
                await until(lambda: ep_a.num_requests_waiting == 2)
                assert ep_a.num_requests_running == 3 and ep_a.kv_cache_usage_perc == 0.5
                async with s.get(base + "/metrics") as r:
                    text = await r.text()
                for needle in (
                    f'kvserve_router_requests_total{{endpoint="{b.url}",status="200"}} 1.0',
                    'kvserve_router_routing_decisions_total{reason="single_candidate"} 2.0',
                    'kvserve_router_rejected_total{status="404"} 1.0',
                    "kvserve_router_request_seconds_bucket",
                    "kvserve_router_kv_index_blocks 0.0",
                    f'kvserve_router_endpoint_waiting{{endpoint="{a.url}"}} 2.0',
                    f'kvserve_router_endpoint_healthy{{endpoint="{b.url}"}} 1.0',
                ):
                    assert needle in text, needle
        finally:
            await stop_all(router, a, b)

    arun(main)


async def _read_event(stream: aiohttp.StreamReader) -> bytes:
    return await asyncio.wait_for(stream.readuntil(b"\n\n"), 5)


def test_stream_is_passed_through_chunk_by_chunk() -> None:
    async def main() -> None:
        b = await FakeBackend("b").start()
        b.gate = asyncio.Event()
        b.chunks = 3
        router = await start_router([b.url])
        try:
            async with aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}/v1/completions"
                async with s.post(url, json={"model": "m", "prompt": "x", "stream": True}) as r:
                    assert r.status == 200
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    # The backend holds after chunk 0: it must reach us before chunk 1 exists.
                    first = await _read_event(r.content)
                    assert json.loads(first[6:])["choices"][0]["text"] == "b-0"
                    assert not b.gate.is_set()
                    b.gate.set()
                    rest = await asyncio.wait_for(r.content.read(), 5)
                events = [e for e in rest.split(b"\n\n") if e]
                texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
                assert texts == ["b-1", "b-2"] and events[-1] == b"data: [DONE]"
            assert b.completed == 1
        finally:
            await stop_all(router, b)

    arun(main)


def test_failover_before_first_byte() -> None:
    async def main() -> None:
        a = await FakeBackend("a").start()
        b = await FakeBackend("b").start()
        c = await FakeBackend("c").start()
        router = await start_router(
            [a.url, b.url, c.url], health={"interval_s": 30, "metrics_interval_s": 30}
        )
        try:
            async with aiohttp.ClientSession() as s:
                await a.stop()  # refuses connections now; the router still thinks it is up
                b.fail_status = 503  # answers, but with a server error
                served = []
                for _ in range(6):
                    status, data, ep = await post(s, router, {"model": "m", "prompt": "x"})
                    assert status == 200, data
                    served.append(ep)
                assert set(served) == {c.url}
                assert not router.pool.endpoints[a.url].healthy  # taken out at once
                assert router.pool.endpoints[b.url].healthy  # a 5xx is not an outage
                assert len(b.requests) >= 1  # tried, then failed over
                # When every attempt fails with 5xx, the last answer is passed through.
                c.fail_status = 500
                status, data, ep = await post(s, router, {"model": "m", "prompt": "x"})
                assert status == 500 and data["error"]["message"] == "boom"
                async with s.get(f"http://127.0.0.1:{router.port}/metrics") as r:
                    text = await r.text()
                assert (
                    f'kvserve_router_failovers_total{{endpoint="{a.url}",error="connect"}}' in text
                )
                assert 'kvserve_router_routing_decisions_total{reason="failover"}' in text
        finally:
            await stop_all(router, b, c)

    arun(main)


def test_unhealthy_endpoints_are_taken_out_and_come_back() -> None:
    async def main() -> None:
        a = await FakeBackend("a").start()
        b = await FakeBackend("b").start()
        router = await start_router([a.url, b.url])
        ep_a = router.pool.endpoints[a.url]
        try:
            async with aiohttp.ClientSession() as s:
                a.healthy = False
                await until(lambda: not ep_a.healthy)
                n_a = len(a.requests)
                for _ in range(4):
                    status, _, ep = await post(s, router, {"model": "m", "prompt": "x"})
                    assert status == 200 and ep == b.url
                assert len(a.requests) == n_a
                a.healthy = True
                await until(lambda: ep_a.healthy)
                served = {
                    (await post(s, router, {"model": "m", "prompt": "x"}))[2] for _ in range(4)
                }
                assert served == {a.url, b.url}
                # A dead process: out after the health checks fail, /health says so when all are.
                await a.stop()
                await b.stop()
                await until(lambda: not router.pool.healthy())
                async with s.get(f"http://127.0.0.1:{router.port}/health") as r:
                    assert r.status == 503
                status, data, _ = await post(s, router, {"model": "m", "prompt": "x"})
                assert status == 503
        finally:
            await router.stop()

    arun(main)


def test_client_disconnect_cancels_the_upstream_request() -> None:
    async def main() -> None:
        b = await FakeBackend("b").start()
        b.chunks, b.chunk_interval = 400, 0.025  # a 10 s stream
        router = await start_router([b.url])
        ep = router.pool.endpoints[b.url]
        try:
            s = aiohttp.ClientSession()
            r = await s.post(
                f"http://127.0.0.1:{router.port}/v1/completions",
                json={"model": "m", "prompt": "x", "stream": True},
            )
            await _read_event(r.content)
            assert ep.in_flight == 1
            r.close()  # the client goes away mid-stream
            await s.close()
            await until(lambda: b.disconnects == 1, timeout=5)
            assert b.completed == 0
            await until(lambda: ep.in_flight == 0, timeout=5)
        finally:
            await stop_all(router, b)

    arun(main)


def _stored(tokens: list[int], first_hash: int) -> BlockStored:
    n = len(tokens) // BS
    return BlockStored(
        block_hashes=list(range(first_hash, first_hash + n)),
        parent_block_hash=None,
        token_ids=tokens[: n * BS],
        block_size=BS,
        medium="GPU",
    )


def test_requests_go_where_the_kv_events_say_the_prefix_is() -> None:
    async def main() -> None:
        a = await FakeBackend("a").start()
        b = await FakeBackend("b").start()
        pa = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv@a@m")
        pb = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv@b@m")
        router = await start_router(
            [
                {"url": a.url, "kv_events": pa.endpoint, "kv_events_replay": pa.replay_endpoint},
                {"url": b.url, "kv_events": pb.endpoint, "kv_events_replay": pb.replay_endpoint},
            ],
            scheduler={"scorers": [{"name": "precise_prefix", "weight": 3}, {"name": "load"}]},
        )
        try:
            # The router joins late: it gets this batch through a replay.
            pb.publish([_stored(PROMPT, 1)])
            await until(lambda: router.index.endpoint_num_blocks(b.url) == 6)
            async with aiohttp.ClientSession() as s:
                for i in range(4):
                    body = {"model": "m", "prompt": PROMPT[: 5 * BS + i], "max_tokens": 1}
                    status, _, ep = await post(s, router, body)
                    assert status == 200 and ep == b.url
                # b's cache is cleared and a now holds the prefix.
                pb.publish([AllBlocksCleared()])
                pa.publish([_stored(PROMPT, 7)])
                await until(
                    lambda: (
                        router.index.endpoint_num_blocks(a.url) == 6
                        and router.index.endpoint_num_blocks(b.url) == 0
                    )
                )
                for _ in range(3):
                    status, _, ep = await post(s, router, {"model": "m", "prompt": PROMPT})
                    assert status == 200 and ep == a.url
                async with s.get(f"http://127.0.0.1:{router.port}/metrics") as r:
                    text = await r.text()
                assert 'kvserve_router_routing_decisions_total{reason="precise_prefix"} 7.0' in text
                assert "kvserve_router_kv_index_blocks 6.0" in text
                assert f'kvserve_router_kv_event_lag_seconds{{endpoint="{a.url}"}}' in text
        finally:
            await stop_all(router, a, b)
            pa.close()
            pb.close()

    arun(main)


def test_endpoints_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    async def main() -> None:
        a = await FakeBackend("a").start()
        b = await FakeBackend("b").start()
        path = tmp_path / "endpoints.yaml"
        path.write_text(f"- url: {a.url}\n")
        router = await start_router([], endpoints_file=str(path))
        try:
            assert list(router.pool.endpoints) == [a.url]
            path.write_text(json.dumps({"endpoints": [{"url": a.url}, {"url": b.url}]}))
            await until(lambda: b.url in router.pool.endpoints)
            await until(lambda: router.pool.endpoints[b.url].healthy)
            path.write_text("- url: [broken\n")  # a bad edit keeps the last good list
            await asyncio.sleep(0.3)
            assert set(router.pool.endpoints) == {a.url, b.url}
            path.write_text(f"- url: {b.url}\n")
            await until(lambda: a.url not in router.pool.endpoints)
            async with aiohttp.ClientSession() as s:
                for _ in range(3):
                    assert (await post(s, router, {"model": "m", "prompt": "x"}))[2] == b.url
        finally:
            await stop_all(router, a, b)

    arun(main)


@pytest.mark.parametrize("stream", [False, True])
def test_token_id_prompts_long_and_batched(stream: bool) -> None:
    async def main() -> None:
        b = await FakeBackend("b").start()
        router = await start_router([b.url])
        try:
            async with aiohttp.ClientSession() as s:
                long = list(range(20000))  # hashed off the event loop
                body = {"model": "m", "prompt": long, "stream": stream}
                async with s.post(f"http://127.0.0.1:{router.port}/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
                status, _, _ = await post(s, router, {"model": "m", "prompt": [[1, 2], [3]]})
                assert status == 200
            assert b.requests[0]["prompt"] == long
        finally:
            await stop_all(router, b)

    arun(main)


def test_slow_health_checks_do_not_take_out_an_endpoint_that_answers_requests() -> None:
    """An overloaded router sees health checks time out; requests answered meanwhile prove the
    endpoint is up, so it stays in. Without answered requests the timeouts take it out."""

    async def main() -> None:
        a = FakeBackend("a")
        release = asyncio.Event()

        async def slow_health(request: Any) -> Any:
            await release.wait()  # never answers in time while the gate is closed
            return await FakeBackend._health(a, request)

        a._health = slow_health  # type: ignore[method-assign]
        await a.start()
        release.set()
        router = await start_router([a.url], health={"interval_s": 3600, "timeout_s": 0.2})
        try:
            ep = router.pool.endpoints[a.url]
            assert ep.healthy
            release.clear()
            async with aiohttp.ClientSession() as s:
                for _ in range(3):  # each check times out, but requests were answered meanwhile
                    task = asyncio.create_task(router.pool.check(ep))
                    await asyncio.sleep(0.05)
                    status, _, _ = await post(s, router, {"model": "m", "prompt": "x"})
                    assert status == 200
                    assert await task and ep.healthy
                for _ in range(2):  # unhealthy_after = 2 timeouts with nothing answered
                    await router.pool.check(ep)
                assert not ep.healthy
        finally:
            release.set()
            await stop_all(router, a)

    arun(main)


def test_without_kv_events_a_repeated_prefix_follows_the_routing_history() -> None:
    """Default scheduler, endpoints without KV events: the router's own history of where each
    prefix went (approximate prefix) keeps a conversation on one endpoint."""

    async def main() -> None:
        backends = [await FakeBackend(n).start() for n in "abc"]
        router = await start_router([b.url for b in backends], scheduler={})
        try:
            async with aiohttp.ClientSession() as s:
                for conv in range(4):
                    prompt = [1000 * conv + i for i in range(8 * BS)]
                    served = set()
                    for _ in range(4):
                        prompt = prompt + [7] * BS  # the next turn extends the conversation
                        status, _, ep = await post(s, router, {"model": "m", "prompt": prompt})
                        assert status == 200
                        served.add(ep)
                    assert len(served) == 1, served
            assert router.history.size() > 0
        finally:
            await stop_all(router, *backends)

    arun(main)
