"""Property-based API test of a real `kvserve route` process in front of a fake backend:
request bodies drawn from the router's own /openapi.json (valid ones, and the same with
fields dropped, retyped or nested), raw JSON and non-JSON bytes, and requests broken at the
HTTP level. Whatever comes in, the router answers without a 5xx, every error in OpenAI's
shape (``code`` a string or null), and it keeps answering."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .processes import fake_backends, is_openai_error, parse_response, router_process

_SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
_JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
_ANY_JSON = st.recursive(
    _JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def from_schema(schema: dict[str, Any] | bool, defs: dict[str, Any]) -> st.SearchStrategy:
    """Values valid for a (pydantic-generated) JSON schema: the subset the wire models use."""
    if not isinstance(schema, dict):  # `true`: anything
        return _ANY_JSON
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=40)
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        return st.integers(min_value=lo, max_value=hi if hi is not None else 2**40)
    if kind == "number":
        lo, hi = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
        return st.floats(
            min_value=lo,
            max_value=hi,
            exclude_min="exclusiveMinimum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = schema.get("items", {})
        return st.lists(from_schema(items, defs), min_size=1, max_size=4)
    if kind == "object" and "properties" in schema:
        props = schema["properties"]
        required = set(schema.get("required", ()))
        fixed = {k: from_schema(props[k], defs) for k in required}
        optional = {k: from_schema(v, defs) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(fixed, optional=optional)
    if kind == "object":
        values = schema.get("additionalProperties", {"type": "number"})
        return st.dictionaries(st.text(max_size=8), from_schema(values, defs), max_size=3)
    return _ANY_JSON


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory):
    """A router process in front of one fake backend, and its OpenAPI document."""
    tmp = tmp_path_factory.mktemp("router-properties")
    with fake_backends(1) as urls, router_process(tmp, {"endpoints": urls}) as url:
        port = int(url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/openapi.json")
        doc = json.loads(conn.getresponse().read())
        conn.close()
        yield port, doc


def _exchange(port: int, method: str, path: str, body: bytes, headers: dict[str, str]):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _check(status: int, headers: dict[str, str], data: bytes) -> None:
    assert status < 500, (status, data[:300])
    if status >= 400:
        resp = parse_response(b"HTTP/1.1 %d X\r\n\r\n%b" % (status, data))
        assert is_openai_error(resp), data[:300]
        if status == 405:
            assert "Allow" in headers or "allow" in headers


def _mutate(body: dict[str, Any], draw: Any) -> Any:
    """A valid body made invalid in one of several ways (or left alone)."""
    how = draw(st.sampled_from(["keep", "drop", "retype", "nest", "extra", "wrap"]))
    body = dict(body)
    if how == "drop" and body:
        body.pop(draw(st.sampled_from(sorted(body))))
    elif how == "retype" and body:
        body[draw(st.sampled_from(sorted(body)))] = draw(_ANY_JSON)
    elif how == "nest":
        key = draw(st.sampled_from(sorted(body) or ["prompt"]))
        depth = draw(st.sampled_from([10, 500, 5000]))
        value: Any = body.get(key)
        for _ in range(depth):
            value = [value]
        body[key] = value
    elif how == "extra":
        body[draw(st.text(min_size=1, max_size=10))] = draw(_ANY_JSON)
    elif how == "wrap":
        return [body]
    return body


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bodies_from_the_schema_never_get_a_5xx(router, route: str) -> None:
    port, doc = router
    defs = doc["components"]["schemas"]
    ref = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    bodies = from_schema(ref, defs)
    stats: Counter = Counter()

    @_SETTINGS
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        body = data.draw(bodies)
        if data.draw(st.booleans()):  # mostly a model the backend serves
            body["model"] = data.draw(st.sampled_from(["m", None]))
        body = _mutate(body, data.draw)
        try:
            raw = json.dumps(body).encode()
        except (ValueError, RecursionError):
            return
        status, headers, out = _exchange(
            port, "POST", route, raw, {"content-type": "application/json"}
        )
        stats[status] += 1
        _check(status, headers, out)

    check()
    assert stats[200] > 10, stats  # the valid ones went through


@_SETTINGS
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    path=st.sampled_from(
        ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"]
        + ["/openapi.json", "/router/state", "/version", "/v1/x", "/", "/v1/completions/"]
    )
    | st.text(alphabet="/abcv1?=&%.", min_size=1, max_size=20).map(lambda s: "/" + s),
    body=st.binary(max_size=200)
    | _ANY_JSON.map(lambda v: json.dumps(v).encode())
    | st.sampled_from([b"[" * 100_000, b'{"a":' * 3000, b'"\\ud800"', b'{"prompt":"\\udc00"}']),
    content_type=st.sampled_from(["application/json", "text/plain", "", "application/x-y"]),
)
def test_any_method_path_and_bytes_never_get_a_5xx(router, method, path, body, content_type):
    port, _ = router
    headers = {"content-type": content_type} if content_type else {}
    status, resp_headers, out = _exchange(port, method, path, body, headers)
    _check(status, resp_headers, out)


@settings(_SETTINGS, max_examples=50)
@given(
    head=st.lists(
        st.sampled_from(
            [
                b"content-length: 5",
                b"content-length: -1",
                b"content-length: 99999999999",
                b"transfer-encoding: chunked",
                b"transfer-encoding: gzip",
                b"upgrade: h2c",
                b"connection: Upgrade, HTTP2-Settings",
                b"http2-settings: AAMAAABkAARAAAAAAAIAAAAA",
                b"expect: 100-continue",
                b"x-junk",
                b"\x00\xff: \x01",
                b"host: a\r\nhost: b",
            ]
        ),
        max_size=5,
    ),
    line=st.sampled_from(
        [
            b"POST /v1/completions HTTP/1.1",
            b"GET /health HTTP/1.1",
            b"GET /health HTTP/1.0",
            b"CONNECT x:1 HTTP/1.1",
            b"POST /v1/completions HTTP/2.0",
            b"GET  HTTP/1.1",
            b"\x16\x03\x01",
        ]
    ),
    rest=st.binary(max_size=64),
)
def test_broken_http_gets_a_4xx_or_a_closed_connection(router, head, line, rest) -> None:
    port, _ = router
    data = line + b"\r\n" + b"".join(h + b"\r\n" for h in head) + b"\r\n" + rest
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        s.settimeout(0.5)  # answers come at once; a request still incomplete waits
        with contextlib.suppress(TimeoutError):
            while chunk := s.recv(65536):
                out += chunk
    for answer in out.split(b"HTTP/1.1 ")[1:]:
        assert int(answer[:3]) < 500, out[:300]
    # And the router still serves.
    status, _, _ = _exchange(port, "GET", "/health", b"", {})
    assert status == 200
