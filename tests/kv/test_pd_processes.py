"""P/D disaggregation between real `kvserve serve` processes, driven over HTTP the way a
vLLM-style proxy drives it: the prefill leg (``max_tokens=1``, ``kv_transfer_params:
{"do_remote_decode": true}``) on the producer, then the decode leg on the consumer with the
``kv_transfer_params`` the producer returned.

Oracle: the decode leg's text equals an engine that recomputes everything. Failure paths with
real processes: the producer killed (nothing listening), stopped (SIGSTOP: the pull stalls),
and a client that disconnects from the decode leg while its pull is stalled. After each test
both engines' pools and leases are back to baseline (read from /metrics).
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from tests.server.conftest import ServeProcess, start_serve_process

ENGINE_ARGS = ("--num-kv-blocks", "160", "--max-model-len", "1024", "--max-num-seqs", "8")
HTTP_TIMEOUT = 120.0


def serve(model_dir: Path, *args: str) -> ServeProcess:
    return start_serve_process(model_dir, *ENGINE_ARGS, *args)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    eng = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=200, enable_prefix_caching=False)
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def producer(tiny_model_dir: Path) -> Iterator[ServeProcess]:
    p = serve(tiny_model_dir, "--kv-role", "producer", "--kv-lease-timeout", "600")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def consumer(tiny_model_dir: Path) -> Iterator[ServeProcess]:
    p = serve(tiny_model_dir, "--kv-transfer-config", '{"kv_role":"kv_consumer"}',
              "--kv-transfer-timeout", "3")  # fmt: skip
    yield p
    p.stop()


@pytest.fixture
def processes(tiny_model_dir: Path):
    """``processes(*args)`` -> a fresh serve process, stopped (resumed first) at the end."""
    started: list[ServeProcess] = []

    def start(*args: str) -> ServeProcess:
        p = serve(tiny_model_dir, *args)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.signal_all(signal.SIGCONT)
        p.stop()


def reference_text(reference: LLMEngine, prompt: list[int], max_tokens: int) -> str:
    rid = reference.add_request(None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    while True:
        for out in reference.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0].text


def metrics(url: str) -> dict[str, float]:
    """``vllm:...`` gauges by name, connector stats by key."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("kvserve:kv_connector_stat{"):
            key = name.split('key="', 1)[1].split('"', 1)[0]
            out[key] = float(value)
        else:
            out[name.split("{", 1)[0]] = float(value)
    return out


def wait_baseline(url: str, timeout: float = 60.0) -> dict[str, float]:
    """Until the engine holds no request, no block and no lease."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (
            m["vllm:kv_cache_usage_perc"] == 0
            and m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m.get("pd_leases_active", 0) == 0
            and m.get("pd_pulls_inflight", 0) == 0
        )
        if idle:
            return m
        assert time.monotonic() < deadline, f"{url} not back to baseline: {m}"
        time.sleep(0.1)


# What vLLM's disaggregated-serving example proxy sends on the prefill leg.
VLLM_PROXY_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_leg(
    url: str, body: dict, path: str = "/v1/completions", ktp: dict | None = None
) -> dict:
    ktp = ktp or {"do_remote_decode": True}
    leg = dict(body, max_tokens=1, stream=False, kv_transfer_params=ktp)
    r = httpx.post(url + path, json=leg, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_request_id"]
    return params


def decode_leg(url: str, body: dict, params: dict, path: str = "/v1/completions") -> dict:
    r = httpx.post(url + path, json=dict(body, kv_transfer_params=params), timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def stream_text(url: str, body: dict, params: dict, path: str = "/v1/completions") -> str:
    import json

    text = []
    leg = dict(body, stream=True, kv_transfer_params=params)
    with httpx.stream("POST", url + path, json=leg, timeout=HTTP_TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for ch in chunk["choices"]:
                text.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    return "".join(text)


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


def test_prefill_then_decode_over_http(producer, consumer, reference) -> None:
    rng = random.Random(0)
    prompts = [rand_prompt(rng, n) for n in (40, 200, 600)]
    for i, prompt in enumerate(prompts):
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        params = prefill_leg(producer.url, body, ktp=VLLM_PROXY_PREFILL if i == 2 else None)
        assert len(params["remote_block_ids"]) == len(prompt) // 16
        want = reference_text(reference, prompt, 24)
        if i == 1:  # the decode leg streams the answer
            assert stream_text(consumer.url, body, params) == want
            continue
        resp = decode_leg(consumer.url, body, params)
        assert resp["choices"][0]["text"] == want
        assert resp["kv_transfer_params"] is None
        usage = resp["usage"]
        assert usage["kvserve"]["cached_tokens_offload"] == len(prompt) // 16 * 16
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(prompt) // 16 * 16
    p, c = wait_baseline(producer.url), wait_baseline(consumer.url)
    total = sum(len(p) // 16 for p in prompts)
    assert c["pd_blocks_pulled"] >= total and c["pd_blocks_invalid"] == 0
    assert p["pd_blocks_sent"] >= total and p["pd_leases_pulled"] >= 3


def test_chat_prefill_then_decode(producer, consumer, reference) -> None:
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 8},
        {"role": "user", "content": "Tell me about paged attention and prefix caching. " * 4},
    ]
    body = {"messages": messages, "max_tokens": 20, "temperature": 0}
    params = prefill_leg(producer.url, body, "/v1/chat/completions")
    assert len(params["remote_block_ids"]) > 4
    text = stream_text(consumer.url, body, params, "/v1/chat/completions")
    prompt = reference.tokenizer.encode_chat(messages)
    assert text == reference_text(reference, prompt, 20)
    wait_baseline(producer.url)
    wait_baseline(consumer.url)


def test_bad_kv_transfer_params_are_refused(consumer) -> None:
    url = consumer.url + "/v1/completions"
    base = {"prompt": [5, 6, 7], "max_tokens": 2}
    bad = [
        dict(base, kv_transfer_params={"do_remote_prefill": True, "remote_port": "x"}),
        dict(base, kv_transfer_params={"do_remote_prefill": "yes"}),
        dict(base, kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": [-1]}),
        dict(base, kv_transfer_params={"do_remote_decode": True}, stream=True),
        dict(base, kv_transfer_params={"do_remote_decode": True}, n=2),
        dict(base, prompt=[[5, 6], [7, 8]], kv_transfer_params={"do_remote_decode": True}),
        dict(base, kv_transfer_params=[1, 2]),
    ]
    for body in bad:
        r = httpx.post(url, json=body, timeout=HTTP_TIMEOUT)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"]
    wait_baseline(consumer.url)


def test_producer_killed_decode_recomputes(processes, consumer, reference) -> None:
    rng = random.Random(1)
    prompt = rand_prompt(rng, 300)
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
    prod = processes("--kv-role", "producer")
    params = prefill_leg(prod.url, body)
    prod.proc.kill()
    prod.proc.wait()
    before = metrics(consumer.url).get("pd_pulls_failed", 0)
    t0 = time.monotonic()
    resp = decode_leg(consumer.url, body, params)
    assert time.monotonic() - t0 < 60
    assert resp["choices"][0]["text"] == reference_text(reference, prompt, 16)
    assert resp["usage"]["kvserve"]["cached_tokens_offload"] == 0
    assert wait_baseline(consumer.url)["pd_pulls_failed"] == before + 1


def test_producer_stopped_decode_recomputes_in_bounded_time(processes, consumer, reference):
    """SIGSTOP: the producer's kernel still accepts the connection, nothing answers. The
    consumer gives up after its 3 s transfer timeout; once resumed, the producer finds the
    pull gone and frees its blocks at once (its lease would last 600 s)."""
    rng = random.Random(2)
    prompt = rand_prompt(rng, 300)
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
    prod = processes("--kv-role", "producer", "--kv-lease-timeout", "600")
    params = prefill_leg(prod.url, body)
    prod.signal_all(signal.SIGSTOP)
    t0 = time.monotonic()
    resp = decode_leg(consumer.url, body, params)
    waited = time.monotonic() - t0
    assert 3 <= waited < 60
    assert resp["choices"][0]["text"] == reference_text(reference, prompt, 16)
    assert resp["usage"]["kvserve"]["cached_tokens_offload"] == 0
    wait_baseline(consumer.url)
    prod.signal_all(signal.SIGCONT)
    m = wait_baseline(prod.url, timeout=60)
    assert m["pd_leases_pulled"] == 1 and m["pd_leases_expired"] == 0


def test_client_gone_while_pulling_releases_both_sides(processes) -> None:
    """The decode leg's client disconnects while the pull is stalled (producer stopped): the
    consumer frees the request's blocks at once (not after its 120 s transfer timeout); the
    resumed producer frees its leased blocks."""
    rng = random.Random(3)
    prompt = rand_prompt(rng, 300)
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
    prod = processes("--kv-role", "producer", "--kv-lease-timeout", "600")
    cons = processes("--kv-role", "consumer", "--kv-transfer-timeout", "120")
    params = prefill_leg(prod.url, body)
    prod.signal_all(signal.SIGSTOP)
    leg = dict(body, stream=True, kv_transfer_params=params)
    url = cons.url + "/v1/completions"
    # Leaving the block closes the connection mid-stream.
    with httpx.stream("POST", url, json=leg, timeout=HTTP_TIMEOUT) as r:
        assert r.status_code == 200
        deadline = time.monotonic() + 60
        while metrics(cons.url).get("pd_pulls_inflight", 0) < 1:
            assert time.monotonic() < deadline, "the pull never started"
            time.sleep(0.05)
        assert metrics(cons.url)["vllm:kv_cache_usage_perc"] > 0
    t0 = time.monotonic()
    m = wait_baseline(cons.url, timeout=60)
    assert time.monotonic() - t0 < 30
    assert m["pd_pulls_failed"] == 1
    prod.signal_all(signal.SIGCONT)
    m = wait_baseline(prod.url, timeout=60)
    assert m["pd_leases_pulled"] == 1 and m["pd_leases_expired"] == 0


def test_bad_pd_flags_exit_with_a_message(tiny_model_dir: Path) -> None:
    import subprocess
    import sys

    for flags in (["--kv-role", "decoder"], ["--kv-transfer-config", '{"kv_port": "x"}']):
        proc = subprocess.run(
            [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tiny_model_dir), *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("kvserve serve: kv") and "Traceback" not in proc.stderr
