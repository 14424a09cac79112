"""API details users hit: malformed text (lone surrogates, deep nesting), 405 with Allow, the
/health body, the OpenAPI schema, continuous usage in streams, chat template kwargs,
response_format, logprobs=0, and the developer/tool roles."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import httpx
import pytest

from .test_slow_clients import _addr, _read_response

PROMPT = "The quick brown fox jumps over the lazy dog because"
MSGS = [{"role": "user", "content": "Name three colours."}]


def _post(http: httpx.Client, path: str, body: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


def _events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _request(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def test_lone_surrogates_are_400_and_the_connection_stays(served):
    """JSON escapes of half a UTF-16 pair, or the raw bytes of one, are not text: 400 (was a
    500 from the tokenizer that also dropped the keep-alive connection)."""
    good = json.dumps({"model": served.model, "prompt": "hi", "max_tokens": 2}).encode()
    bad = [
        ("/v1/completions", b'{"prompt": "a\\ud800b"}'),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}'),
        ("/v1/completions", b'{"prompt": "a\xed\xa0\x80b"}'),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}'),
        ("/v1/completions", b'{"model": "\\ud800", "prompt": "hi"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ]
    with socket.create_connection(_addr(served), timeout=30) as s:
        for path, body in bad:
            s.sendall(_request(path, body))
            head, resp, _ = _read_response(s)
            assert head.startswith("HTTP/1.1 400"), (body, head, resp)
            err = json.loads(resp)["error"]
            assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
            # The same connection serves the next request.
            s.sendall(_request("/v1/completions", good))
            head, resp, _ = _read_response(s)
            assert head.startswith("HTTP/1.1 200"), resp
    served.wait_idle()


def test_deep_nesting_and_non_json_are_400(served):
    with served.http() as http:
        for body in (
            b"[" * 100_000 + b"]" * 100_000,
            b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
            b'{"prompt": "hi", "temperature": NaN}',
            b"prompt=hi",
        ):
            resp = _post(http, "/v1/completions", body)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["message"]


def test_405_names_the_allowed_methods(served):
    with served.http() as http:
        for method, path, allow in [
            ("GET", "/v1/completions", "POST"),
            ("PUT", "/v1/chat/completions", "POST"),
            ("POST", "/health", "GET"),
            ("DELETE", "/v1/models", "GET"),
        ]:
            resp = http.request(method, path)
            assert resp.status_code == 405, resp.text
            assert resp.headers["allow"] == allow
            assert resp.json()["error"]["type"] == "invalid_request_error"


def test_health_has_a_small_body(served):
    with served.http() as http:
        resp = http.get("/health")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def test_openapi_documents_what_is_sent(served):
    with served.http() as http:
        spec = http.get("/openapi.json").json()
    for path, req in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ]:
        op = spec["paths"][path]["post"]
        assert "422" not in op["responses"]  # never sent: bad input is a 400
        assert {"400", "401", "404", "413", "429"} <= set(op["responses"])
        content = op["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content)
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{req}"
    schemas = spec["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions"} <= set(
        schemas
    )
    assert "HTTPValidationError" not in schemas
    # Every reference resolves.
    refs = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.add(node["$ref"].rsplit("/", 1)[1])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec)
    assert refs <= set(schemas), refs - set(schemas)
    assert not any(
        "422" in op.get("responses", {}) for p in spec["paths"].values() for op in p.values()
    )


def test_continuous_usage_stats(served):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {
        "model": served.model,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": opts,
    }
    prompt_tokens = len(served.engine.tokenizer.encode(PROMPT))
    with served.http() as http:
        events = _events(http, "/v1/completions", {**body, "prompt": PROMPT, "logprobs": 0})
        *chunks, last = events
        assert chunks and all(c["usage"] is not None for c in chunks)
        done = [c["usage"]["completion_tokens"] for c in chunks]
        assert done == sorted(done) and done[-1] == 5 and done[0] >= 1
        for c in chunks:
            u = c["usage"]
            assert u["prompt_tokens"] == prompt_tokens
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
        chat = _events(http, "/v1/chat/completions", {**body, "messages": MSGS})
        assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chat[0]["usage"]["completion_tokens"] == 0
        assert all(c["usage"] is not None for c in chat)
        assert chat[-2]["usage"]["completion_tokens"] == 5
        # Without include_usage, as in vLLM, no usage at all.
        plain = _events(
            http,
            "/v1/completions",
            {**body, "prompt": PROMPT, "stream_options": {"continuous_usage_stats": True}},
        )
        assert all(c.get("usage") is None for c in plain)
    served.wait_idle()


@pytest.fixture(scope="module")
def greeting_model_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """The tiny model with a chat template that reads a ``greeting`` variable."""
    out = tmp_path_factory.mktemp("greeting") / "tiny-greeting"
    shutil.copytree(tiny_model_dir, out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{%- if greeting is defined -%}{{ '<|system|>\\n' + greeting + '<|eot|>\\n' }}"
        "{%- endif -%}" + cfg["chat_template"]
    )
    cfg_path.write_text(json.dumps(cfg))
    return out


def test_chat_template_kwargs_reach_the_template(server_factory, greeting_model_dir):
    served = server_factory(model_dir=greeting_model_dir)
    tok = served.engine.tokenizer
    greeting = "Welcome, traveller, to the land of many tokens"
    body = {"model": served.model, "messages": MSGS, "max_tokens": 1}
    with served.http() as http:
        plain = _post(http, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"]
        kw = {**body, "chat_template_kwargs": {"greeting": greeting}}
        resp = _post(http, "/v1/chat/completions", kw)
        assert resp.status_code == 200, resp.text
        expected = tok.encode(tok.apply_chat_template(MSGS, True, greeting=greeting))
        assert resp.json()["usage"]["prompt_tokens"] == len(expected) > plain
        for reserved in ("messages", "add_generation_prompt", "bos_token"):
            resp = _post(
                http, "/v1/chat/completions", {**body, "chat_template_kwargs": {reserved: 1}}
            )
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == "chat_template_kwargs"
    served.wait_idle()


def test_response_format(served):
    body = {"model": served.model, "prompt": "hi", "max_tokens": 2}
    chat = {"model": served.model, "messages": MSGS, "max_tokens": 2}
    with served.http() as http:
        for path, b in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            resp = _post(http, path, {**b, "response_format": {"type": "text"}})
            assert resp.status_code == 200, resp.text
            for fmt in (
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
                {"type": "yaml"},
            ):
                resp = _post(http, path, {**b, "response_format": fmt})
                assert resp.status_code == 400, resp.text
                assert resp.json()["error"]["param"] == "response_format"
    served.wait_idle()


def test_logprobs_zero_returns_the_sampled_token(served):
    with served.http() as http:
        for temperature in (0, 1.0):
            body = {
                "model": served.model,
                "prompt": PROMPT,
                "max_tokens": 4,
                "logprobs": 0,
                "temperature": temperature,
                "seed": 7,
            }
            lp = _post(http, "/v1/completions", body).json()["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(lp["top_logprobs"]) == 4
            for token, token_lp, top in zip(
                lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
            ):
                assert top == {token: pytest.approx(token_lp)}
        # logprobs=2: the two most likely and the sampled token (3 at most, as vLLM).
        body.update(logprobs=2, temperature=1.0)
        lp = _post(http, "/v1/completions", body).json()["choices"][0]["logprobs"]
        for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
            assert token in top and 2 <= len(top) <= 3
    served.wait_idle()


def test_developer_is_system_and_tool_is_a_clean_400(served):
    tok = served.engine.tokenizer
    with served.http() as http:

        def prompt_tokens(messages):
            body = {"model": served.model, "messages": messages, "max_tokens": 1}
            resp = _post(http, "/v1/chat/completions", body)
            assert resp.status_code == 200, resp.text
            return resp.json()["usage"]["prompt_tokens"]

        system = [{"role": "system", "content": "Be brief."}, *MSGS]
        developer = [{"role": "developer", "content": "Be brief."}, *MSGS]
        expected = len(tok.encode_chat(system))
        assert prompt_tokens(developer) == prompt_tokens(system) == expected
        # The tiny model's template has no tool role: 400 naming it, never a 500.
        tool = [*MSGS, {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
        resp = _post(http, "/v1/chat/completions", {"model": served.model, "messages": tool})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "messages" and "tool" in err["message"]
    served.wait_idle()
