"""The router under abuse (issue 17): bursts beyond its connections, huge prompts, slow
clients, missing keys, hostile JSON, HTTP/2 upgrade requests and the API details clients
check. Bursts, huge prompts and slow clients run against a real `kvserve route` process in
front of fake backends in another process."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvserve.cluster.cli import add_arguments, config_from_args
from kvserve.cluster.headers import ENDPOINT_HEADER

from .fake_openai_backend import FakeBackend
from .processes import (
    fake_backends,
    is_openai_error,
    parse_response,
    raw_request,
    router_process,
)
from .test_gateway import arun, post, start_router, stop_all

JSON = {"content-type": "application/json"}


# ------------------------------------------------------------------------------ overload


def test_a_burst_beyond_capacity_queues_then_sheds_without_ejecting_anyone(tmp_path: Path) -> None:
    """1,500 clients at once against 2 backends whose event loops stall (so connects pile up
    in a 16-deep accept backlog) and answer in 0.3 s. The router holds 16 connections per
    backend and queues 200 requests for each: 432 are served, the rest get 503 with
    Retry-After at once, and no backend is ejected (before the fix: connect timeouts took
    both out and clients got 502)."""
    n, conns, queue = 1500, 16, 200
    stall = ["--delay", "0.3", "--backlog", "16", "--stall", "0.3", "--stall-every", "0.5"]
    with fake_backends(2, *stall) as urls:
        cfg = {
            "endpoints": urls,
            "connect_timeout_s": 0.5,
            "health": {"interval_s": 0.5, "timeout_s": 2.0},
            "max_connections_per_endpoint": conns,
            "max_queue_per_endpoint": queue,
        }
        with router_process(tmp_path, cfg) as url:

            async def main() -> tuple[list[Any], dict]:
                body = json.dumps({"model": "m", "prompt": "hello"}).encode()
                results = await asyncio.gather(
                    *(raw_request(url, "POST", "/v1/completions", body, JSON) for _ in range(n))
                )
                state = (await raw_request(url, "GET", "/router/state")).json()
                return results, state

            results, state = asyncio.run(main())
    statuses = Counter(r.status for r in results)
    assert set(statuses) <= {200, 429, 503}, statuses
    shed = [r for r in results if r.status != 200]
    assert all("retry-after" in r.headers and is_openai_error(r) for r in shed)
    # What the connections and queues could hold was served (a queued request may also fail
    # over to the other backend's queue, so at least this many), all but 1%: a loaded CI
    # machine once served 430 of 432 (why those two were shed is not pinned down).
    assert statuses[200] >= 0.99 * 2 * (conns + queue), statuses
    assert statuses[503] > 0, statuses  # beyond capacity: shed, not queued without bound
    for ep in state["endpoints"]:
        assert ep["healthy"] and ep["ejections"] == 0, ep


# ------------------------------------------------------------------------------ huge prompts


def _words_text(n_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["the", "router", "tokenizes", "long", "prompts", "in", "chunks", "of", "text"]
    seps = [" ", " ", " ", "\n", ", ", ". ", "  "]
    parts, size = [], 0
    while size < n_chars:
        w = rng.choice(words) + rng.choice(seps)
        parts.append(w)
        size += len(w)
    return "".join(parts)


def test_health_answers_while_a_huge_prompt_is_tokenized(tmp_path: Path, tiny_model_dir) -> None:
    """A 24 MB completions prompt through a router that tokenizes prompts: /health keeps
    answering within 1 s throughout (before the fix the whole text was tokenized in one call
    holding the GIL: ~15 s of silence), and the request itself is routed."""
    prompt = _words_text(24 << 20)
    with fake_backends(1) as urls:
        cfg = {"endpoints": urls, "tokenizer": str(tiny_model_dir)}
        with router_process(tmp_path, cfg) as url:

            async def main() -> tuple[int, list[float]]:
                body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
                big = asyncio.create_task(
                    raw_request(url, "POST", "/v1/completions", body, JSON, timeout=120)
                )
                latencies = []
                while not big.done():
                    t0 = time.monotonic()
                    r = await raw_request(url, "GET", "/health", timeout=30)
                    latencies.append(time.monotonic() - t0)
                    assert r.status == 200
                    await asyncio.sleep(0.02)
                return (await big).status, latencies

            status, latencies = asyncio.run(main())
    assert status == 200
    assert len(latencies) >= 3 and max(latencies) < 1.0, max(latencies)


def test_prefix_encoder_is_exact_and_stops_at_the_cap(tiny_model_dir) -> None:
    from kvserve.cluster.tokenization import PrefixEncoder, chat_prompt_ids
    from kvserve.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    text = _words_text(200_000, seed=1) + "end\tof\n\n text  "
    whole = tok.encode(text)
    enc = PrefixEncoder(tok, 10**9, chunk_chars=1000)
    assert list(enc.encode(text)) == whole and not enc.truncated  # chunk by chunk, same tokens
    enc = PrefixEncoder(tok, 3000, chunk_chars=1000)
    assert list(enc.encode(text)) == whole[:3000] and enc.truncated  # and no more than needed
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    full_chat = tok.encode_chat(msgs)
    assert list(chat_prompt_ids(tok, msgs, True, 10**9)) == full_chat
    assert list(chat_prompt_ids(tok, msgs, True, 2000)) == full_chat[:2000]
    # A text without a single space still tokenizes (cut where the chunk ends).
    assert len(PrefixEncoder(tok, 500, chunk_chars=1000).encode("x" * 50_000)) == 500


def test_scoring_tokenizes_up_to_the_largest_context_on_bounded_workers(tiny_model_dir) -> None:
    """The router learns each endpoint's context from its model cards and tokenizes a long
    prompt only that far; tokenizer jobs beyond the bound are refused (routed on raw text)."""
    import threading

    from kvserve.cluster.tokenization import TokenizerWorkers

    async def main() -> None:
        a = FakeBackend("a")
        a.max_model_len = 1000
        b = FakeBackend("b")
        b.max_model_len = 3000
        await a.start()
        await b.start()
        router = await start_router(
            [a.url, b.url], tokenizer=str(tiny_model_dir), inline_tokenize_chars=100
        )
        try:
            assert router._max_tokens("m") == 3000
            body = {"model": "m", "prompt": _words_text(100_000)}
            req = await router._routing_request(body, False, None)
            assert req.token_ids is not None and len(req.token_ids) == 3000
            async with aiohttp.ClientSession() as s:
                assert (await post(s, router, body))[0] == 200
        finally:
            await stop_all(router, a, b)

    arun(main)
    workers = TokenizerWorkers(threads=1, max_pending=2)
    gate = threading.Event()
    try:
        jobs = [workers.submit(gate.wait) for _ in range(2)]
        assert all(jobs) and workers.submit(gate.wait) is None and workers.refused == 1
        gate.set()
        for job in jobs:
            assert job is not None and job.result(5)
        assert workers.submit(lambda: 7).result(5) == 7  # room again
    finally:
        gate.set()
        workers.shutdown()


# ------------------------------------------------------------------------------ slow clients


def test_slow_clients_are_cut_off(tmp_path: Path) -> None:
    """200 connections that send half a request head, and 50 that send nothing, are closed
    after the header timeout (1 s here), the half-sent ones with a 408; a body that stops
    coming gets a 408 too; meanwhile others are served (before the fix: held forever)."""
    with fake_backends(1) as urls:
        cfg = {
            "endpoints": urls,
            "header_timeout_s": 1.0,
            "body_timeout_s": 1.0,
            "keep_alive_timeout_s": 1.0,
        }
        with router_process(tmp_path, cfg) as url:
            port = int(url.rsplit(":", 1)[1])

            async def hold(data: bytes) -> tuple[bytes, float]:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                t0 = time.monotonic()
                writer.write(data)
                try:
                    out = await asyncio.wait_for(reader.read(), 20)
                finally:
                    writer.close()
                return out, time.monotonic() - t0

            async def main() -> None:
                half = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-"
                body_stops = (
                    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"
                )
                tasks = [hold(half) for _ in range(200)] + [hold(b"") for _ in range(50)]
                tasks.append(hold(body_stops))
                held = asyncio.gather(*tasks)
                await asyncio.sleep(0.3)
                ok = await raw_request(
                    url, "POST", "/v1/completions", b'{"model":"m","prompt":"x"}', JSON
                )
                assert ok.status == 200
                results = await held
                for _, took in results:
                    assert took < 10, took  # cut at ~1 s (plus the sweep and a loaded box)
                for out, _ in results[:200] + results[-1:]:
                    assert out.startswith(b"HTTP/1.1 408"), out[:60]
                    assert is_openai_error(parse_response(out))
                for out, _ in results[200:250]:
                    assert out == b""  # nothing was sent: closed without an answer

            asyncio.run(main())


# ------------------------------------------------------------------------------ auth


def test_api_keys_guard_the_router_and_the_engines_get_the_upstream_key() -> None:
    async def main() -> None:
        a = await FakeBackend("a").start()
        a.api_key = "engine-key"  # as `kvserve serve --api-key` would
        b = await FakeBackend("b").start()
        b.api_key = "b-key"
        router = await start_router(
            [a.url, {"url": b.url, "api_key": "b-key"}],
            api_keys=["k1", "k2"],
            upstream_api_key="engine-key",
        )
        try:
            # Model discovery with each endpoint's key worked: both are in.
            assert all(e.healthy for e in router.pool.endpoints.values())
            base = f"http://127.0.0.1:{router.port}"
            body = {"model": "m", "prompt": "x"}
            async with aiohttp.ClientSession() as s:
                for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
                    async with s.post(base + "/v1/completions", json=body, headers=headers) as r:
                        assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
                        err = (await r.json())["error"]
                        assert err["code"] == "invalid_api_key" and err["type"]
                        assert err["param"] is None and "Bearer" in err["message"]
                for path in ("/v1/models", "/v1/nope", "/router/state"):
                    async with s.get(base + path) as r:
                        assert r.status == 401, path
                for path in ("/health", "/metrics", "/version", "/openapi.json"):
                    async with s.get(base + path) as r:
                        assert r.status == 200, path
                served = set()
                for _ in range(4):
                    auth = {"Authorization": "Bearer k2"}
                    status, data, ep = await post(s, router, body, headers=auth)
                    assert status == 200, data
                    served.add(ep)
                assert served == {a.url, b.url}
                # The engines saw the router's credentials, never the client's.
                assert {h["Authorization"] for h in a.headers} == {"Bearer engine-key"}
                assert {h["Authorization"] for h in b.headers} == {"Bearer b-key"}
                async with s.get(base + "/router/state", headers=auth) as r:
                    assert r.status == 200 and "b-key" not in await r.text()
        finally:
            await stop_all(router, a, b)

    arun(main)


def test_metrics_can_be_guarded_and_keys_come_from_flags_or_environment(monkeypatch) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    monkeypatch.setenv("KVSERVE_UPSTREAM_API_KEY", "up-env")
    cfg = config_from_args(parser.parse_args(["--endpoint", "http://h:1,api_key=ep-key"]))
    assert cfg.api_keys == ["from-env"] and cfg.upstream_api_key == "up-env"
    assert cfg.endpoints[0].api_key == "ep-key" and "ep-key" not in repr(cfg)
    monkeypatch.setenv("KVSERVE_API_KEY", "kv-env")
    cfg = config_from_args(parser.parse_args(["--endpoint", "http://h:1"]))
    assert cfg.api_keys == ["kv-env", "from-env"]  # both, as `kvserve serve` takes them
    argv = ["--endpoint", "http://h:1", "--api-key", "a", "--api-key", "b"]
    cfg = config_from_args(parser.parse_args(argv + ["--upstream-api-key", "u"]))
    assert cfg.api_keys == ["a", "b"] and cfg.upstream_api_key == "u"

    async def main() -> None:
        b = await FakeBackend("b").start()
        router = await start_router([b.url], api_keys=["k"], api_key_metrics=True)
        try:
            async with aiohttp.ClientSession() as s:
                base = f"http://127.0.0.1:{router.port}"
                async with s.get(base + "/metrics") as r:
                    assert r.status == 401
                async with s.get(base + "/metrics", headers={"Authorization": "Bearer k"}) as r:
                    assert r.status == 200
        finally:
            await stop_all(router, b)

    arun(main)


# ------------------------------------------------------------------------------ API details


def test_errors_are_openai_shaped_with_string_codes() -> None:
    async def main() -> None:
        b = await FakeBackend("b", model="m1").start()
        router = await start_router([b.url])
        base = f"http://127.0.0.1:{router.port}"
        try:
            r = await raw_request(base, "POST", "/v1/completions", b'{"model":"x","prompt":"p"}')
            assert r.status == 404 and is_openai_error(r)
            assert r.json()["error"]["code"] == "model_not_found"
            # Deeply nested JSON: 400, not a RecursionError (500).
            for depth in (5_000, 200_000):
                nested = b"[" * depth + b"]" * depth
                r = await raw_request(base, "POST", "/v1/completions", nested, JSON)
                assert r.status == 400 and is_openai_error(r), r.body[:200]
                nested = b'{"model":"m1","prompt":' + b'{"a":' * depth + b"1" + b"}" * depth
                r = await raw_request(base, "POST", "/v1/chat/completions", nested + b"}", JSON)
                assert r.status == 400 and is_openai_error(r)
            for body in (b"{nope", b"[1]", b'{"model":"m1"}', b'{"model":1,"prompt":"x"}'):
                r = await raw_request(base, "POST", "/v1/completions", body, JSON)
                assert r.status == 400 and is_openai_error(r), body
            r = await raw_request(base, "GET", "/v1/completions")
            assert r.status == 405 and r.headers["allow"] == "POST" and is_openai_error(r)
            r = await raw_request(base, "DELETE", "/health")
            assert r.status == 405 and r.headers["allow"] == "GET"
            r = await raw_request(base, "GET", "/nope")
            assert r.status == 404 and is_openai_error(r)
            r = await raw_request(base, "GET", "/health")
            assert r.status == 200 and r.json() == {"status": "ok", "healthy_endpoints": 1}
            b.fail_status = 400  # an engine's own error is relayed as it is
            r = await raw_request(base, "POST", "/v1/completions", b'{"prompt":"p"}', JSON)
            assert r.status == 400 and r.json()["error"]["message"] == "boom"
        finally:
            await stop_all(router, b)

    arun(main)


def test_openapi_describes_the_router() -> None:
    async def main() -> None:
        b = await FakeBackend("b").start()
        router = await start_router([b.url], api_keys=["k"])
        try:
            r = await raw_request(f"http://127.0.0.1:{router.port}", "GET", "/openapi.json")
        finally:
            await stop_all(router, b)
        doc = r.json()
        assert r.status == 200 and doc["openapi"].startswith("3.")
        assert set(doc["paths"]) >= {
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/health",
            "/metrics",
            "/openapi.json",
        }
        op = doc["paths"]["/v1/completions"]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/CompletionRequest"
        )
        assert "text/event-stream" in op["responses"]["200"]["content"]
        assert {"400", "401", "404", "503"} <= set(op["responses"])
        assert op["security"] == [{"bearer": []}] and "security" not in doc["paths"]["/health"]
        schemas = doc["components"]["schemas"]
        assert {"CompletionRequest", "ChatCompletionRequest", "ErrorResponse"} <= set(schemas)
        assert schemas["ErrorInfo"]["properties"]["code"] == {
            "anyOf": [{"type": "string"}, {"type": "null"}]
        }

    arun(main)


def test_an_h2c_upgrade_request_is_served_as_http11() -> None:
    """`curl --http2` on plain HTTP asks to upgrade to h2c; the router answers the HTTP/1.1
    request (body included) and keeps the connection (before the fix: 400, closed)."""

    async def main() -> None:
        b = await FakeBackend("b").start()
        router = await start_router([b.url])
        try:
            body = b'{"model":"m","prompt":"upgraded"}'
            upgrade = (
                b"host: x\r\nconnection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
                b"http2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
            )
            data = (
                b"GET /health HTTP/1.1\r\n" + upgrade + b"\r\n"
                b"POST /v1/completions HTTP/1.1\r\n" + upgrade + b"content-type: application/json"
                b"\r\ncontent-length: %d\r\n\r\n%b"
                % (len(body), body)
                + b"GET /version HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
            )
            reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
            writer.write(data)
            out = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            answers = out.split(b"HTTP/1.1 ")[1:]
            assert [a[:3] for a in answers] == [b"200", b"200", b"200"], out
            assert b"upgrade" not in out.lower()
            assert b.requests == [json.loads(body)]  # the body reached the engine whole
            forwarded = {k.lower() for k in b.headers[0]}
            assert not forwarded & {"upgrade", "http2-settings", "connection"}
            assert b"from b" in answers[1] and b"version" in answers[2]
        finally:
            await stop_all(router, b)

    arun(main)


def test_engine_overload_answers_fail_over_and_keep_retry_after() -> None:
    """An engine answering 429 (its queue is full) is not the end: the next endpoint is
    tried; when every one is full the last 429 and its Retry-After reach the client."""

    async def main() -> None:
        a = await FakeBackend("a").start()
        b = await FakeBackend("b").start()
        router = await start_router([a.url, b.url])
        try:
            a.fail_status = 429
            async with aiohttp.ClientSession() as s:
                for _ in range(4):
                    status, _, ep = await post(s, router, {"model": "m", "prompt": "x"})
                    assert status == 200 and ep == b.url
                b.fail_status = 429
                url = f"http://127.0.0.1:{router.port}/v1/completions"
                async with s.post(url, json={"model": "m", "prompt": "x"}) as r:
                    assert r.status == 429 and r.headers["Retry-After"] == "2"
                    assert ENDPOINT_HEADER in r.headers
            assert all(e.healthy and e.ejections == 0 for e in router.pool.endpoints.values())
        finally:
            await stop_all(router, a, b)

    arun(main)


@pytest.mark.parametrize("kind", ["refused", "timeout"])
def test_only_a_refused_connection_ejects_at_once(kind: str) -> None:
    """Connection refused: nothing listens, out now. A connect timeout (a full accept
    backlog looks the same) only asks for a health check, which the endpoint passes."""

    async def main() -> None:
        a = await FakeBackend("a").start()
        b = await FakeBackend("b").start()
        router = await start_router(
            [a.url, b.url],
            health={"interval_s": 3600, "metrics_interval_s": 3600},
            scheduler={"picker": {"name": "round_robin"}},
        )
        ep_a = router.pool.endpoints[a.url]
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(2):  # a connection to each, kept alive
                    assert (await post(s, router, {"model": "m", "prompt": "x"}))[0] == 200
                router.upstream.close_origin(ep_a.origin)
                if kind == "refused":
                    await a.stop()
                else:
                    router.upstream.connect_timeout_s = 0.0  # every new connect times out
                for _ in range(2):
                    status, _, _ = await post(s, router, {"model": "m", "prompt": "x"})
                    assert status == 200  # failed over to b (on its kept-alive connection)
            await asyncio.sleep(0.3)  # the probe of a, if any, ran
            assert ep_a.healthy == (kind == "timeout")
            assert ep_a.ejections == (kind == "refused")
        finally:
            await stop_all(router, a, b)

    arun(main)
