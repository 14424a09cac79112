"""A small OpenAI-shaped streaming server (FastAPI + uvicorn on a free port) for testing the
load generator: it is the subject's peer, not the subject, so it only needs to stream with
known timing and record what it was sent.

Behaviour, driven by the prompt / last user message:
- streams ``max_tokens`` tokens; token i of a completion is the text ``" {100 + i}"``, so a
  client can tell which answer it fed back; chat sends the role chunk first, as OpenAI does;
- waits ``ttft`` seconds before the first token and ``itl`` seconds between tokens;
- usage: ``prompt_tokens`` (ids, or words of text), ``cached_tokens`` = longest common
  prefix with any earlier prompt (in the same units);
- a prompt starting with token id 0 or the word ``FAIL`` gets HTTP 400 (OpenAI error body);
  ``DROP`` closes the stream after one token without ``[DONE]``;
- with ``return_token_ids`` each choice also carries ``token_ids`` (vLLM's extension);
- header ``x-kvserve-endpoint: fake-0``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeState:
    ttft: float = 0.05
    itl: float = 0.005
    received: list[dict] = field(default_factory=list)
    prompts: list[list] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    arrivals: list[float] = field(default_factory=list)  # time.perf_counter() per request

    def reset(self, ttft: float = 0.05, itl: float = 0.005) -> None:
        self.ttft, self.itl = ttft, itl
        self.received.clear()
        self.prompts.clear()
        self.arrivals.clear()
        self.in_flight = self.max_in_flight = 0


def _units(prompt) -> list:
    return list(prompt) if isinstance(prompt, list) else prompt.split()


def _cached(state: FakeState, units: list) -> int:
    best = 0
    for p in state.prompts:
        n = 0
        for a, b in zip(p, units, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def build_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    def error(msg: str):
        body = {"error": {"message": msg, "type": "BadRequestError", "code": 400}}
        return JSONResponse(body, status_code=400)

    async def handle(body: dict, chat: bool):
        state.arrivals.append(time.perf_counter())
        state.received.append(body)
        if chat:
            msgs = body.get("messages") or []
            units = " ".join(m["content"] for m in msgs).split()
            first = msgs[-1]["content"].split()[0] if msgs else ""
        else:
            prompt = body.get("prompt")
            if not prompt:
                return error("empty prompt")
            units = _units(prompt)
            first = prompt[0] if isinstance(prompt, list) else prompt.split()[0]
        if first in (0, "FAIL"):
            return error("prompt rejected by the fake server")
        cached = _cached(state, units)
        state.prompts.append(units)
        n = int(body.get("max_tokens") or 16)
        drop = first == "DROP"
        usage = {
            "prompt_tokens": len(units),
            "completion_tokens": n,
            "total_tokens": len(units) + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def gen():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if chat:
                    role = {"delta": {"role": "assistant", "content": ""}, "index": 0}
                    yield f"data: {json.dumps({'choices': [role]})}\n\n"
                await asyncio.sleep(state.ttft)
                for i in range(n):
                    if i:
                        await asyncio.sleep(state.itl)
                    text = f" {100 + i}"
                    fin = "length" if i == n - 1 else None
                    if chat:
                        choice = {"index": 0, "delta": {"content": text}, "finish_reason": fin}
                    else:
                        choice = {"index": 0, "text": text, "finish_reason": fin}
                    if body.get("return_token_ids"):
                        choice["token_ids"] = [100 + i]
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                    if drop:
                        return
                if include_usage:
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        headers = {"x-kvserve-endpoint": "fake-0"}
        return StreamingResponse(gen(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(await request.json(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(await request.json(), chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/health")
    async def health():
        return {}

    return app


@dataclass
class FakeServer:
    url: str
    state: FakeState


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="error"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    try:
        yield FakeServer(f"http://127.0.0.1:{port}", state)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def fake(fake_server):
    fake_server.state.reset()
    return fake_server


@pytest.fixture
def unused_port() -> int:
    """A port nothing listens on (bound then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
