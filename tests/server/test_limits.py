"""Limits of the engine server against a real server: body size, prompt characters,
amplification (sequences, prompts, stop strings, messages) and admission (429 when full)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from kvserve.config import ServerConfig
from kvserve.server.limits import longest_token_chars, max_prompt_chars

from .conftest import MAX_MODEL_LEN


def _post(http: httpx.Client, path: str, body: object) -> httpx.Response:
    return http.post(
        path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )


def _error(resp: httpx.Response, status: int, param: str | None, code: str | None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code), err
    return err


def test_body_over_the_limit_is_413_before_it_is_read(server_factory):
    served = server_factory(ServerConfig(max_request_body_bytes=64 << 10))
    host, port = served.base_url.removeprefix("http://").split(":")
    # Only the head of a 10 MiB body: the answer comes without waiting for the rest.
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10485760\r\n\r\n" + b'{"prompt": "' + b"x" * 1000
        )
        head = sock.recv(65536).decode()
    assert head.startswith("HTTP/1.1 413") and "connection: close" in head.lower()
    assert json.loads(head.split("\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
    with served.http() as http:
        # Chunked (no Content-Length): refused once past the limit.
        resp = http.post(
            "/v1/completions",
            content=iter([b'{"prompt": "', b"x" * (40 << 10), b"x" * (40 << 10), b'"}']),
        )
        _error(resp, 413, None, "request_too_large")
        # Under the limit: served.
        resp = _post(http, "/v1/completions", {"prompt": "hi " * 20, "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        assert http.get("/health").status_code == 200


def test_default_body_limit_is_8_mib(served):
    assert ServerConfig().max_request_body_bytes == 8 << 20
    with served.http() as http:
        resp = _post(http, "/v1/completions", {"prompt": "x" * (9 << 20)})
        _error(resp, 413, None, "request_too_large")


def test_hopelessly_long_text_is_refused_without_tokenizing(served):
    tok = served.engine.tokenizer
    bound = max_prompt_chars(tok, MAX_MODEL_LEN)
    assert bound == MAX_MODEL_LEN * longest_token_chars(tok) * 4
    with served.http() as http:
        # Over the character bound: refused by its length alone.
        for prompt in ("x" * (bound + 1), ["hi", "y" * (bound + 1)]):
            resp = _post(http, "/v1/completions", {"prompt": prompt})
            err = _error(resp, 400, "prompt", "context_length_exceeded")
            assert f"can have ({bound})" in err["message"], err
        chat = {"messages": [{"role": "user", "content": "z" * (bound + 1)}]}
        resp = _post(http, "/v1/chat/completions", chat)
        err = _error(resp, 400, "messages", "context_length_exceeded")
        assert f"can have ({bound})" in err["message"], err
        # Under it but far over the context: refused from a prefix (16 x 256 characters).
        resp = _post(http, "/v1/completions", {"prompt": "word " * 2000})
        err = _error(resp, 400, "prompt", "context_length_exceeded")
        assert "the first 4096 characters of your prompt alone are" in err["message"], err
        resp = _post(
            http,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 2000}]},
        )
        err = _error(resp, 400, "messages", "context_length_exceeded")
        assert "alone are" in err["message"], err
        # A little over the context: tokenized whole, refused by its exact count.
        resp = _post(http, "/v1/completions", {"prompt": "word " * 600})
        err = _error(resp, 400, "prompt", "context_length_exceeded")
        n = len(tok.encode("word " * 600))
        assert f"your prompt has {n} tokens" in err["message"], err
    served.wait_idle()


def test_amplification_limits(served):
    model = served.model
    cases = [
        # 20 prompts x n=16 = 320 sequences (> 256), in a request of a few hundred bytes
        ({"model": model, "prompt": ["a"] * 20, "n": 16}, "n", "too_many_sequences"),
        ({"model": model, "prompt": ["a"] * 257}, "prompt", "too_many_prompts"),
        ({"model": model, "prompt": "a", "stop": ["x"] * 65}, "stop", "too_many_stop_strings"),
        (
            {"model": model, "prompt": "a", "stop": ["y" * 3000, "z" * 3000]},
            "stop",
            "stop_strings_too_long",
        ),
        (
            {"model": model, "prompt": "a", "stop_token_ids": list(range(65))},
            "stop_token_ids",
            "too_many_stop_token_ids",
        ),
        # A token-id prompt longer than the context, refused before it is validated.
        ({"model": model, "prompt": [[1] * 10**5]}, "prompt", "context_length_exceeded"),
    ]
    chats = [
        (
            {"model": model, "messages": [{"role": "user", "content": "a"}] * 2049},
            "messages",
            "too_many_messages",
        ),
        (
            {"model": model, "messages": [{"role": "user", "content": "a"}], "stop": ["s"] * 100},
            "stop",
            "too_many_stop_strings",
        ),
    ]
    with served.http() as http:
        for body, param, code in cases:
            _error(_post(http, "/v1/completions", body), 400, param, code)
        for body, param, code in chats:
            _error(_post(http, "/v1/chat/completions", body), 400, param, code)
        # At the limits: served.
        ok = {"model": model, "prompt": ["a"] * 16, "n": 16, "max_tokens": 1, "stop": ["x"] * 64}
        resp = _post(http, "/v1/completions", ok)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"]) == 256
    served.wait_idle()
    served.engine.check_integrity()


def test_limits_are_configurable(server_factory):
    cfg = ServerConfig(max_seqs_per_request=4, max_stop_strings=1, max_messages=1)
    served = server_factory(cfg)
    with served.http() as http:
        _error(
            _post(http, "/v1/completions", {"prompt": "a", "n": 5}), 400, "n", "too_many_sequences"
        )
        body = {"prompt": "a", "stop": ["x", "y"]}
        _error(_post(http, "/v1/completions", body), 400, "stop", "too_many_stop_strings")
        msgs = [{"role": "user", "content": "a"}] * 2
        resp = _post(http, "/v1/chat/completions", {"messages": msgs})
        _error(resp, 400, "messages", "too_many_messages")
        resp = _post(http, "/v1/completions", {"prompt": "a", "n": 4, "max_tokens": 1})
        assert resp.status_code == 200


def test_full_queue_answers_429_with_retry_after(server_factory):
    """2 running + 2 waiting at most: a 5th sequence is refused at once, not queued."""
    served = server_factory(ServerConfig(max_waiting_requests=2), max_num_seqs=2)
    gate = threading.Event()
    runner = served.engine.runner
    real_execute = runner.execute_model

    def gated_execute(scheduler_output):  # holds the engine's steps until the gate opens
        gate.wait(60)
        return real_execute(scheduler_output)

    runner.execute_model = gated_execute
    body = {"model": served.model, "prompt": "Hello there", "max_tokens": 4}
    results: list[int] = []

    def request() -> None:
        with served.http() as http:
            results.append(_post(http, "/v1/completions", body).status_code)

    threads = [threading.Thread(target=request) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while served.async_engine.num_inflight < 4:
            assert time.monotonic() < deadline, served.async_engine.num_inflight
            time.sleep(0.01)
        with served.http() as http:
            resp = _post(http, "/v1/completions", body)
            err = _error(resp, 429, None, "engine_overloaded")
            assert resp.headers["retry-after"] == "1" and err["type"] == "rate_limit_error"
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            _error(_post(http, "/v1/chat/completions", chat), 429, None, "engine_overloaded")
            # More sequences than the server ever holds: 400, retrying cannot help.
            resp = _post(http, "/v1/completions", {**body, "n": 5})
            _error(resp, 400, "n", "too_many_sequences")
            assert http.get("/health").status_code == 200
            rejected = [
                line
                for line in http.get("/metrics").text.splitlines()
                if line.startswith("kvserve:request_rejected_total") and 'status="429"' in line
            ]
            assert rejected and float(rejected[0].rsplit(" ", 1)[1]) == 2
    finally:
        gate.set()
        for t in threads:
            t.join(60)
    assert results == [200] * 4
    served.wait_idle()
    with served.http() as http:
        assert _post(http, "/v1/completions", body).status_code == 200
    served.wait_idle()
    served.engine.check_integrity()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_wrong_types_still_name_the_field(served, path):
    """The limit checks read the raw JSON; wrong types there are left to validation."""
    with served.http() as http:
        for field, value in [("n", "5"), ("stop", 7), ("stop_token_ids", "x")]:
            body = {"prompt": "a", "messages": [{"role": "user", "content": "a"}], field: value}
            resp = _post(http, path, body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
