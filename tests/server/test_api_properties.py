"""Property-based API test against a real `kvserve serve` process (API key from VLLM_API_KEY).

Hypothesis generates completions and chat bodies, valid and malformed (wrong types, ranges,
unicode including lone surrogates, nesting, raw bytes). Whatever the body: no 5xx, errors in
OpenAI's shape, successes in the API's shape, streams made of JSON events ending in [DONE].
Sized to run in well under a minute.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import start_serve_process

API_KEY = "sk-property-test"
MODEL = "tiny-props"
MAX_MODEL_LEN = 128
EXAMPLES = int(os.environ.get("KVSERVE_API_EXAMPLES", "200"))  # ~20 s on 2 busy cores

# -- strategies ----------------------------------------------------------------------------------

_SURROGATES = st.sampled_from(["a\ud800b", "\udfff", "\ud83d", "x\udc00"])
_text = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(codec="utf-8"), max_size=20),
    st.sampled_from(["", " ", "The quick brown fox", "\u00e9\u4e2d\U0001f600", "\x00"]),
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _text | _SURROGATES,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_text, kids, max_size=4),
    max_leaves=12,
)
_deep = st.integers(1, 3000).map(lambda d: json.loads("[" * d + "]" * d) if d < 900 else None)
_weird = _json | _deep | _SURROGATES

_token_ids = st.lists(st.integers(-5, 3000), min_size=0, max_size=40)
_int = st.one_of(st.integers(-3, 20), st.integers(), st.sampled_from([2**63, -(2**63) - 1]))
_float = st.one_of(st.floats(-1, 3), st.floats(allow_nan=True, allow_infinity=True))
_stop = st.one_of(_text, st.lists(_text, max_size=5), st.lists(_text, min_size=60, max_size=70))

# Values of the right type (some out of range); _mutated() then puts anything anywhere.
_common = {
    "model": st.sampled_from([MODEL, MODEL, MODEL, "gpt-4", ""]),
    "n": st.integers(-1, 20),
    "max_tokens": st.integers(-2, 8),
    "temperature": _float,
    "top_p": _float,
    "top_k": _int,
    "seed": _int,
    "stop": _stop,
    "stop_token_ids": _token_ids,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "min_tokens": st.integers(-1, 10),
    "ignore_eos": st.booleans(),
    "presence_penalty": _float,
    "logit_bias": st.dictionaries(_text, _float, max_size=2),
    "cache_salt": _text,
    "user": _text,
    "kv_transfer_params": st.dictionaries(
        st.sampled_from(["do_remote_prefill", "do_remote_decode", "remote_block_ids"]) | _text,
        _json,
        max_size=3,
    ),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "text", "json_object", "json_schema"])}
    ),
}

completion_bodies = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            _text, st.lists(_text, max_size=4), _token_ids, st.lists(_token_ids, max_size=3)
        )
    },
    optional={
        **_common,
        "logprobs": st.integers(-1, 25),
        "echo": st.booleans(),
        "best_of": st.integers(0, 3),
        "suffix": _text,
    },
)

_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "user", "assistant", "tool"]),
        "content": st.one_of(
            _text,
            _text,
            st.none(),
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text})),
        ),
    },
    optional={"name": _text},
)
chat_bodies = st.fixed_dictionaries(
    {"messages": st.lists(_message, min_size=1, max_size=4)},
    optional={
        **_common,
        "max_completion_tokens": st.integers(-1, 8),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 25),
        "add_generation_prompt": st.booleans(),
        "chat_template_kwargs": st.dictionaries(_text, _json, max_size=3),
        "tools": st.lists(st.dictionaries(_text, _json, max_size=2), max_size=2),
    },
)


def _mutated(body: st.SearchStrategy, fields: list[str]) -> st.SearchStrategy[dict]:
    """The body with 0-2 fields (or nested message fields) replaced by anything at all."""

    def apply(args: tuple[dict, list[tuple[str, object]]]) -> dict:
        out, changes = args
        out = dict(out)
        for name, value in changes:
            if name.startswith("messages.") and isinstance(out.get("messages"), list):
                msgs = [dict(m) if isinstance(m, dict) else m for m in out["messages"]]
                if msgs and isinstance(msgs[0], dict):
                    msgs[0][name.split(".", 1)[1]] = value
                out["messages"] = msgs
            else:
                out[name] = value
        return out

    change = st.tuples(st.sampled_from(fields), _weird)
    return st.tuples(body, st.lists(change, max_size=2)).map(apply)


def _encoded(body: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """JSON of the body (NaN as JSON's non-standard token, surrogates as \\u escapes), now
    and then cut short, or raw bytes."""
    as_json = body.map(lambda b: json.dumps(b).encode())
    cut = st.tuples(as_json, st.integers(1, 200)).map(lambda t: t[0][: t[1]])
    kinds = {"json": as_json, "cut": cut, "raw": st.binary(max_size=64)}
    return st.sampled_from(["json"] * 8 + ["cut", "raw"]).flatmap(kinds.__getitem__)


_COMPLETION_FIELDS = ["prompt", "logprobs", "echo", "best_of", "suffix", *_common]
_CHAT_FIELDS = [
    "messages",
    "messages.role",
    "messages.content",
    "messages.name",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
    "chat_template_kwargs",
    "tools",
    *_common,
]


# -- the server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    proc = start_serve_process(
        tiny_model_dir,
        "--served-model-name", MODEL,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", "256",
        "--max-num-seqs", "32",
        env={"VLLM_API_KEY": API_KEY, "KVSERVE_API_KEY": ""},
    )  # fmt: skip
    http = httpx.Client(
        base_url=proc.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    try:
        yield http
    finally:
        http.close()
        proc.stop()


STATUSES: Counter[int] = Counter()  # of the generated requests, to see the mix is useful


def _check(resp: httpx.Response, body: bytes) -> None:
    STATUSES[resp.status_code] += 1
    assert resp.status_code < 500, (body[:300], resp.status_code, resp.text[:500])
    ctype = resp.headers.get("content-type", "")
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        assert err["param"] is None or isinstance(err["param"], str)
        return
    assert resp.status_code == 200
    if ctype.startswith("text/event-stream"):
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", resp.text[-300:]
        for event in events[:-1]:
            payload = json.loads(event)
            assert "error" not in payload, payload
            assert "choices" in payload
    else:
        payload = resp.json()
        assert payload["choices"] and payload["usage"]["total_tokens"] >= 0


def test_key_from_the_environment_is_required(server):
    resp = httpx.get(str(server.base_url) + "/v1/models")
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(str(server.base_url) + "/health").status_code == 200
    assert server.get("/v1/models").json()["data"][0]["id"] == MODEL


_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)


@_settings
@given(body=_encoded(_mutated(completion_bodies, _COMPLETION_FIELDS)))
def test_completions_never_5xx(server, body: bytes):
    resp = server.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    _check(resp, body)


@_settings
@given(body=_encoded(_mutated(chat_bodies, _CHAT_FIELDS)))
def test_chat_never_5xx(server, body: bytes):
    resp = server.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    _check(resp, body)


def test_server_still_healthy_and_idle(server):
    if STATUSES:  # after the property tests: both paths were exercised
        total = sum(STATUSES.values())
        assert STATUSES[200] >= 0.05 * total and STATUSES[400] >= 0.5 * total, STATUSES
    assert server.get("/health").json() == {"status": "ok"}
    metrics = server.get("/metrics").text
    running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_run")]
    assert running and float(running[0].rsplit(" ", 1)[1]) == 0.0
