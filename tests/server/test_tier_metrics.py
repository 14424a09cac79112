"""A served engine with a storage tier: per-tier counters on /metrics, cached tokens in usage
for a prompt another server computed (through the shared file system tier)."""

from __future__ import annotations

import time

from tests.server.test_api_server import parse_metrics


def metric(served, name: str) -> float:
    """Sum of ``name`` over its series (one per tier)."""
    with served.http() as http:
        values = parse_metrics(http.get("/metrics").text)
    return sum(v for k, v in values.items() if k.startswith(name + "{"))


def test_shared_tier_metrics_and_cached_tokens(server_factory, tmp_path) -> None:
    tier = [f"fs:path={tmp_path / 'kv'},size=0.05"]
    kw = dict(kv_offload_size=0.01, kv_offload_block_size=16, kv_tier=tier)
    prompt = " ".join(f"word{i}" for i in range(60))
    a = server_factory(**kw)
    with a.http() as http:
        r = http.post("/v1/completions", json={"model": a.model, "prompt": prompt,
                                               "max_tokens": 2, "temperature": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        want = r.json()["choices"][0]["text"]
    deadline = time.monotonic() + 20  # the cascade write is asynchronous
    while metric(a, "kvserve:kv_tier_written_total") < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(a, "kvserve:kv_tier_written_total") >= 4
    assert metric(a, "kvserve:kv_tier_write_bytes_total") > 0
    b = server_factory(**kw)
    with b.http() as http:
        r = http.post("/v1/completions", json={"model": b.model, "prompt": prompt,
                                               "max_tokens": 2, "temperature": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
    assert body["choices"][0]["text"] == want
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert metric(b, "kvserve:kv_tier_hits_total") >= 4
    assert metric(b, "kvserve:kv_tier_corrupt_total") == 0
    b.wait_idle()
