"""API keys on the engine server: bearer check on /v1/*, 401 in OpenAI's shape, /health open."""

from __future__ import annotations

import openai
import pytest

from kvserve.config import ServerConfig
from kvserve.server.auth import resolve_api_keys

KEYS = ["sk-first", "sk-second"]


def _is_401(resp) -> None:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"


def test_v1_needs_a_key_health_and_metrics_do_not(server_factory):
    served = server_factory(ServerConfig(api_key=KEYS))
    body = {"model": served.model, "prompt": "hi", "max_tokens": 2}
    with served.http() as http:
        _is_401(http.get("/v1/models"))
        _is_401(http.post("/v1/completions", json=body))
        _is_401(http.post("/v1/chat/completions", json={}))
        _is_401(http.get("/v1/no-such-route"))  # no probing of routes without a key
        for bad in (
            "Bearer sk-firs",
            "Bearer sk-first2",
            "Basic sk-first",
            "sk-first",
            "Bearer  x",
        ):
            _is_401(http.get("/v1/models", headers={"Authorization": bad}))
        for key in KEYS:
            auth = {"Authorization": f"Bearer {key}"}
            assert http.get("/v1/models", headers=auth).status_code == 200
            resp = http.post("/v1/completions", json=body, headers=auth)
            assert resp.status_code == 200, resp.text
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        assert http.get("/openapi.json").status_code == 200
    # The official client: AuthenticationError without the key, served with it.
    with pytest.raises(openai.AuthenticationError):
        served.client().models.list()
    good = openai.OpenAI(base_url=served.base_url + "/v1", api_key=KEYS[1], max_retries=0)
    assert good.completions.create(**body).choices[0].text is not None


def test_key_on_every_endpoint_but_health(server_factory):
    served = server_factory(ServerConfig(api_key=KEYS[:1], api_key_all_endpoints=True))
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    with served.http() as http:
        for path in ("/metrics", "/version", "/openapi.json", "/v1/models"):
            _is_401(http.get(path))
            assert http.get(path, headers=auth).status_code == 200
        assert http.get("/health").status_code == 200


def test_no_keys_no_check(served):
    with served.http() as http:
        assert http.get("/v1/models").status_code == 200
        wrong = {"Authorization": "Bearer whatever"}
        assert http.get("/v1/models", headers=wrong).status_code == 200


def test_keys_from_flags_else_environment():
    env = {"VLLM_API_KEY": "v", "KVSERVE_API_KEY": "k"}
    assert resolve_api_keys(["a", "b"], env) == ["a", "b"]
    assert resolve_api_keys(None, env) == ["v", "k"]
    assert resolve_api_keys([], {"KVSERVE_API_KEY": "k"}) == ["k"]
    assert resolve_api_keys(None, {"VLLM_API_KEY": ""}) == []
