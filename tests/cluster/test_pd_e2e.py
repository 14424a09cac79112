"""P/D end to end, every process real: `kvserve route` with ``pd.threshold`` in front of one
prefill engine (``kvserve serve --kv-role producer``) and one decode engine (``--kv-role
consumer``), both publishing KV events, the tiny model.

Oracle: greedy outputs equal a single engine that computes everything (prefix caching off),
for split requests, for a request that partly hits the decode side's prefix cache (only the
missing blocks are pulled), for one the decode side holds almost whole (not split), and after
the prefill engine is killed (the decode engine prefills itself). After each test both
engines hold no request, no block, no lease and no pull (their /metrics)."""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.bench.local_cluster import free_port
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from tests.server.conftest import ServeProcess, start_serve_process

from .processes import metric_samples, router_process

pytestmark = pytest.mark.slow
THRESHOLD = 64
ENGINE_ARGS = ("--num-kv-blocks", "200", "--max-model-len", "1024", "--num-threads", "1")
TIMEOUT = 120.0


def engine(model_dir: Path, *args: str) -> tuple[ServeProcess, str, str]:
    ev, rp = free_port(), free_port()
    events, replay = f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}"
    proc = start_serve_process(
        model_dir,
        *ENGINE_ARGS,
        *("--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay),
        *args,
    )
    return proc, events, replay


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    eng = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=200, enable_prefix_caching=False)
    )
    yield eng
    eng.shutdown()


def reference_text(reference: LLMEngine, prompt: list[int], max_tokens: int) -> str:
    rid = reference.add_request(None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    while True:
        for out in reference.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0].text


def engine_state(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    out = {
        name: sum(metric_samples(text, name).values())
        for name in (
            "vllm:kv_cache_usage_perc",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
        )
    }
    for labels, v in metric_samples(text, "kvserve:kv_connector_stat").items():
        out[dict(labels)["key"]] = v
    return out


def wait_baseline(url: str, timeout: float = 60.0) -> dict[str, float]:
    """Until the engine holds no request, no block, no lease and no pull in flight."""
    deadline = time.monotonic() + timeout
    while True:
        m = engine_state(url)
        if (
            m["vllm:kv_cache_usage_perc"] == 0
            and m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m.get("pd_leases_active", 0) == 0
            and m.get("pd_pulls_inflight", 0) == 0
        ):
            return m
        assert time.monotonic() < deadline, f"{url} not back to baseline: {m}"
        time.sleep(0.1)


class PDCluster:
    def __init__(self, tmp_path: Path, model_dir: Path) -> None:
        self.tmp_path, self.model_dir = tmp_path, model_dir

    def __enter__(self) -> PDCluster:
        self.prefill, pe, pr = engine(self.model_dir, "--kv-role", "producer")
        self.decode, de, dr = engine(
            self.model_dir, "--kv-transfer-config", '{"kv_role": "kv_consumer"}'
        )
        cfg = {
            "endpoints": [
                {"url": self.prefill.url, "name": "prefill", "role": "prefill"}
                | {"kv_events": pe, "kv_events_replay": pr},
                {"url": self.decode.url, "name": "decode", "role": "decode"}
                | {"kv_events": de, "kv_events_replay": dr},
            ],
            "tokenizer": str(self.model_dir),
            "health": {"interval_s": 0.5, "timeout_s": 5.0},
            "pd": {"threshold": THRESHOLD},
        }
        self._router = router_process(self.tmp_path, cfg)
        self.url = self._router.__enter__()
        deadline = time.monotonic() + 60
        while True:  # both endpoints healthy and their event streams connected
            st = httpx.get(self.url + "/router/state", trust_env=False).json()
            if all(e["healthy"] and e["kv_events"]["batches"] >= 0 for e in st["endpoints"]):
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self._router.__exit__(*exc)
        for p in (self.prefill, self.decode):
            if p.proc.poll() is None:
                p.signal_all(signal.SIGCONT)
            p.stop()

    def complete(self, prompt: list[int], max_tokens: int = 16, stream: bool = False):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if not stream:
            r = httpx.post(
                self.url + "/v1/completions", json=body, timeout=TIMEOUT, trust_env=False
            )
            assert r.status_code == 200, r.text
            return r.headers, r.json()["choices"][0]["text"], r.json()["usage"]
        text = []
        body["stream"] = True
        with httpx.stream(
            "POST", self.url + "/v1/completions", json=body, timeout=TIMEOUT, trust_env=False
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    text += [c["text"] for c in chunk["choices"]]
            return r.headers, "".join(text), None

    def wait_indexed(self, name: str, blocks: int) -> None:
        """Until the router's index holds at least ``blocks`` blocks of ``name``."""
        deadline = time.monotonic() + 20
        while True:
            st = httpx.get(self.url + "/router/state", trust_env=False).json()
            if {e["name"]: e["kv_blocks"] for e in st["endpoints"]}[name] >= blocks:
                return
            assert time.monotonic() < deadline, st
            time.sleep(0.1)


def test_split_outputs_equal_a_single_engine_and_partial_hits_pull_only_the_rest(
    tmp_path: Path, tiny_model_dir: Path, reference: LLMEngine
) -> None:
    rng = random.Random(7)
    with PDCluster(tmp_path, tiny_model_dir) as c:
        # Below the threshold: the decode engine alone; above: split (streamed or not).
        for n, stream, split in ((40, False, "false"), (300, False, "true"), (500, True, "true")):
            prompt = [rng.randrange(10, 2000) for _ in range(n)]
            headers, text, _ = c.complete(prompt, stream=stream)
            assert headers["x-kvserve-disaggregated"] == split, dict(headers)
            assert headers["x-kvserve-decode-endpoint"] == "decode"
            assert text == reference_text(reference, prompt, 16)
        pulled = wait_baseline(c.decode.url)["pd_blocks_pulled"]
        assert pulled == 300 // 16 + 500 // 16

        # A conversation: its first turn is split; the decode engine now holds it.
        turn1 = [rng.randrange(10, 2000) for _ in range(320)]
        headers, text, _ = c.complete(turn1)
        assert headers["x-kvserve-disaggregated"] == "true"
        c.wait_indexed("decode", 320 // 16)
        # Turn 2 adds 200 tokens: split again, only the blocks past turn 1 are pulled.
        turn2 = turn1 + [rng.randrange(10, 2000) for _ in range(200)]
        before = wait_baseline(c.decode.url)["pd_blocks_pulled"]
        headers, text, usage = c.complete(turn2)
        assert headers["x-kvserve-disaggregated"] == "true"
        assert text == reference_text(reference, turn2, 16)
        after = wait_baseline(c.decode.url)["pd_blocks_pulled"]
        assert after - before == 520 // 16 - 320 // 16
        assert usage["prompt_tokens_details"]["cached_tokens"] == 520 // 16 * 16
        # Turn 3 adds 20 tokens: the decode engine holds nearly all, it serves alone.
        c.wait_indexed("decode", 520 // 16)
        turn3 = turn2 + [rng.randrange(10, 2000) for _ in range(20)]
        headers, text, usage = c.complete(turn3)
        assert headers["x-kvserve-disaggregated"] == "false"
        assert headers["x-kvserve-pd-reason"] == "below_threshold"
        assert text == reference_text(reference, turn3, 16)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 512
        p, d = wait_baseline(c.prefill.url), wait_baseline(c.decode.url)
        assert d["pd_blocks_invalid"] == 0 and p["pd_leases_pulled"] == p["pd_leases_created"]


def test_prefill_engine_killed_then_the_decode_engine_prefills(
    tmp_path: Path, tiny_model_dir: Path, reference: LLMEngine
) -> None:
    rng = random.Random(8)
    with PDCluster(tmp_path, tiny_model_dir) as c:
        prompt = [rng.randrange(10, 2000) for _ in range(300)]
        headers, text, _ = c.complete(prompt)
        assert headers["x-kvserve-disaggregated"] == "true"
        c.prefill.proc.kill()
        c.prefill.proc.wait()
        for n in (300, 400):
            prompt = [rng.randrange(10, 2000) for _ in range(n)]
            headers, text, _ = c.complete(prompt, stream=n == 400)
            assert headers["x-kvserve-disaggregated"] == "false"
            assert headers["x-kvserve-pd-reason"] in (
                "prefill_failed:connect",  # the first one finds it dead
                "no_prefill_endpoint",  # then it is out of the rotation
            )
            assert text == reference_text(reference, prompt, 16)
        wait_baseline(c.decode.url)


def test_client_gone_during_the_decode_leg_leaves_nothing_held(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    rng = random.Random(9)
    with PDCluster(tmp_path, tiny_model_dir) as c:
        prompt = [rng.randrange(10, 2000) for _ in range(400)]
        body = {"prompt": prompt, "max_tokens": 400, "stream": True}
        with httpx.stream(
            "POST", c.url + "/v1/completions", json=body, timeout=TIMEOUT, trust_env=False
        ) as r:
            assert r.headers["x-kvserve-disaggregated"] == "true"
            next(r.iter_raw())  # the first event, then the client goes away
        wait_baseline(c.decode.url)
        p = wait_baseline(c.prefill.url)
        assert p["pd_leases_active"] == 0
