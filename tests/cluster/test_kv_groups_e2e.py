"""Hybrid model end to end: two real `kvserve serve` engines on a Gemma-3-shaped model (one
full-attention KV group, five sliding-window groups of 32 tokens) behind a real
`kvserve route`. Small KV pools and short prefill chunks make every engine recycle its sliding
groups' out-of-window blocks while it prefills (each a BlockRemoved of that group), so the
router's index must keep the full-attention group's blocks: a session's next turn goes back to
the engine holding its prefix and is served from its cache."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from kvserve.bench.local_cluster import ClusterSpec, LocalCluster

pytestmark = pytest.mark.slow

BOUND_S = 30.0  # a loaded 2-core CI box: index changes are expected within a second or two
BS = 16
PROMPT_BLOCKS = 12


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    from kvserve.model.presets import make_model

    return make_model(tmp_path_factory.mktemp("tiny_gemma3"), preset="tiny-gemma3")


@pytest.fixture(scope="module")
def cluster(gemma3_dir, tmp_path_factory):
    spec = ClusterSpec(
        model_dir=str(gemma3_dir),
        num_engines=2,
        engine_args=[
            "--num-kv-blocks", "64",
            "--max-num-batched-tokens", "32",
            "--num-threads", "1",
        ],
        log_dir=str(tmp_path_factory.mktemp("cluster-logs")),
    )  # fmt: skip
    with LocalCluster(spec) as c:
        yield c


def _state(cluster: LocalCluster) -> dict[str, int]:
    r = httpx.get(cluster.router_url + "/router/state", timeout=10, trust_env=False)
    return {e["name"]: e["kv_blocks"] for e in r.json()["endpoints"]}


def _complete(client: httpx.Client, url: str, prompt: list[int]) -> tuple[str, int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    cached = (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return r.headers["x-kvserve-endpoint"], cached


def test_long_prefix_session_returns_to_the_engine_holding_it(cluster):
    rng = random.Random(15)
    landed: set[str] = set()
    with httpx.Client(timeout=120, trust_env=False) as client:
        url = cluster.router_url
        # Sessions one after another (each evicts the previous ones on a 64-block pool); cold
        # turns tie and go anywhere: at least four, and until both engines took some.
        n = 0
        while n < 4 or len(landed) < 2:
            assert n < 20, "cold sessions should spread over both engines"
            n += 1
            prompt = [rng.randrange(10, 2000) for _ in range(PROMPT_BLOCKS * BS)]
            first, _ = _complete(client, url, prompt)
            landed.add(first)
            # The engine published its blocks (all groups) and its sliding groups' evictions.
            t0 = time.monotonic()
            while _state(cluster).get(first, 0) < PROMPT_BLOCKS - 1:
                # (An index that let a sliding group's BlockRemoved drop the block for every
                # group loses the prefix here.)
                assert time.monotonic() - t0 < BOUND_S, "the router's index lost the session"
                time.sleep(0.1)
            turn2 = prompt + [rng.randrange(10, 2000) for _ in range(20)]
            endpoint, cached = _complete(client, url, turn2)
            assert endpoint == first, f"session {n} moved from {first} to {endpoint}"
            # Its whole prompt (12 blocks) from the engine's cache: the full-attention group
            # holds them all and every sliding group the window before the hit.
            assert cached >= (PROMPT_BLOCKS - 1) * BS, cached
