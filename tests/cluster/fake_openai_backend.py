"""A small real OpenAI-shaped HTTP server (aiohttp) to put behind the router in gateway tests.

It serves /health, /v1/models, /metrics (vLLM metric names), /v1/completions and
/v1/chat/completions (JSON or SSE stream), records what it received, and can be told to be
unhealthy, to fail with a status, to hold a stream between chunks, to stream slowly, to take
``delay`` seconds per completion, to require an API key on /v1/* (as an engine does), or to
listen with a small accept backlog.

P/D, as vLLM's engines under its contract: a request with ``kv_transfer_params:
{"do_remote_decode": true}`` (a prefill leg) is answered with a top-level
``kv_transfer_params`` naming this backend as the producer (``remote_engine_id``, block ids,
host, port), after ``prefill_delay`` seconds (or without them: ``pd_no_params``); a decode
leg (``do_remote_prefill``) says in its text whose KV it pulled. Every request body and its
headers are recorded.

Control (for a backend in another process): ``POST /_fake/config`` sets attributes from a
JSON object (``fail_status``, ``delay``, ``prefill_delay``, ``pd_no_params``, ``chunks``,
``chunk_interval``, ``healthy``, ...); ``GET /_fake/state`` returns the recorded requests,
headers and counters; ``POST /_fake/reset`` forgets them.

Run as a process (``python -m tests.cluster.fake_openai_backend --count 2 ...``) it prints
one JSON line with its ports and serves until killed; ``--stall S --stall-every T`` blocks
its event loop S seconds every T seconds, as an engine busy with a step would, so that a
burst of connects piles up in its accept backlog.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from aiohttp import web


class FakeBackend:
    def __init__(self, name: str, model: str = "m") -> None:
        self.name = name
        self.model = model
        self.healthy = True
        self.fail_status: int | None = None
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.running = 0.0
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.chunks = 3
        self.chunk_interval = 0.0
        self.gate: asyncio.Event | None = None  # stream: hold after the first chunk
        self.disconnects = 0  # streams the client went away from
        self.completed = 0
        self.delay = 0.0  # seconds per completion
        self.api_key: str | None = None  # required on /v1/* when set
        self.backlog = 128
        self.max_model_len: int | None = None  # reported in /v1/models when set
        self.prefill_delay = 0.0  # extra seconds for a prefill leg (do_remote_decode)
        self.pd_no_params = False  # answer prefill legs without kv_transfer_params
        self.prefill_legs = 0
        self.decode_legs = 0
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FakeBackend:
        app = web.Application(client_max_size=256 << 20, middlewares=[self._auth])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/_fake/config", self._config)
        app.router.add_get("/_fake/state", self._state)
        app.router.add_post("/_fake/reset", self._reset)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            "127.0.0.1",
            port or self.port or 0,
            reuse_address=True,
            backlog=self.backlog,
        )
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        wanted = f"Bearer {self.api_key}"
        if (
            self.api_key
            and request.path.startswith("/v1/")
            and (request.headers.get("Authorization") != wanted)
        ):
            return web.json_response({"error": {"message": "no"}}, status=401)
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503, text="")

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "owned_by": "t"}
        if self.max_model_len:
            card["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{self.model}"}} {self.running}\n'
            f'vllm:num_requests_waiting{{model_name="{self.model}"}} {self.waiting}\n'
            f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} {self.kv_usage}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    _SETTABLE = frozenset(
        {
            "fail_status",
            "delay",
            "prefill_delay",
            "pd_no_params",
            "chunks",
            "chunk_interval",
            "healthy",
            "running",
            "waiting",
            "kv_usage",
        }
    )

    async def _config(self, request: web.Request) -> web.Response:
        values = await request.json()
        unknown = set(values) - self._SETTABLE
        if unknown:
            return web.json_response({"error": f"not settable: {sorted(unknown)}"}, status=400)
        for k, v in values.items():
            setattr(self, k, v)
        return web.json_response({"ok": True})

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "name": self.name,
                "requests": self.requests,
                "headers": self.headers,
                "completed": self.completed,
                "disconnects": self.disconnects,
                "prefill_legs": self.prefill_legs,
                "decode_legs": self.decode_legs,
            }
        )

    async def _reset(self, request: web.Request) -> web.Response:
        self.requests, self.headers = [], []
        self.completed = self.disconnects = self.prefill_legs = self.decode_legs = 0
        return web.json_response({"ok": True})

    def _producer_params(self, n: int) -> dict[str, Any]:
        """What a prefill engine returns: where the decode side pulls the blocks from."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{self.name}",
            "remote_block_ids": [n * 10 + 1, n * 10 + 2],
            "remote_host": "127.0.0.1",
            "remote_port": self.port,
            "remote_request_id": f"prefill-{self.name}-{n}",
        }

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.fail_status:
            retry = {"Retry-After": "2"} if self.fail_status in (429, 503) else None
            return web.json_response(
                {"error": {"message": "boom"}}, status=self.fail_status, headers=retry
            )
        ktp = body.get("kv_transfer_params")
        prefill = isinstance(ktp, dict) and bool(ktp.get("do_remote_decode"))
        pulled = ktp.get("remote_engine_id") if isinstance(ktp, dict) else None
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if prefill:
                self.prefill_legs += 1
                if self.prefill_delay:
                    await asyncio.sleep(self.prefill_delay)
            elif pulled:
                self.decode_legs += 1
        except asyncio.CancelledError:
            self.disconnects += 1
            raise
        text = f"from {self.name}" + (f" pulled from {pulled}" if pulled else "")
        if not body.get("stream"):
            self.completed += 1
            answer: dict[str, Any] = {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
            if ktp is not None:  # vLLM: a top-level field of non-streaming responses
                answer["kv_transfer_params"] = (
                    self._producer_params(self.prefill_legs)
                    if prefill and not self.pd_no_params
                    else None
                )
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(self.chunks):
                piece = f"{self.name}-{i}" + (f" pulled from {pulled}" if pulled and not i else "")
                chunk = {"choices": [{"index": 0, "text": piece}], "model": self.model}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if i == 0 and self.gate is not None:
                    await self.gate.wait()
                if self.chunk_interval:
                    await asyncio.sleep(self.chunk_interval)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise
        self.completed += 1
        return resp


async def _serve(args: argparse.Namespace) -> None:
    backends = []
    for i in range(args.count):
        b = FakeBackend(f"b{i}", model=args.model)
        b.delay, b.api_key, b.backlog = args.delay, args.api_key, args.backlog
        backends.append(await b.start())
    print(json.dumps({"ports": [b.port for b in backends]}), flush=True)
    while True:
        await asyncio.sleep(args.stall_every or 3600)
        if args.stall:
            time.sleep(args.stall)  # the loop is busy: nothing is accepted meanwhile


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="fake OpenAI backends for router tests")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--model", default="m")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--api-key")
    p.add_argument("--backlog", type=int, default=128)
    p.add_argument("--stall", type=float, default=0.0)
    p.add_argument("--stall-every", type=float, default=0.0)
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
