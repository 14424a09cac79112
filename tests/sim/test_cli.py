"""`kvserve sim` as users run it: a real process serving the OpenAI API, /metrics with vLLM's
names and KV events on real ZMQ sockets, several instances (and an oracle router) in one
process; and many instances in one asyncio loop in this process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml
import zmq

from kvserve.config import ServerConfig
from kvserve.kv.events import BlockStored, decode_batch
from kvserve.sim.instance import SimCluster, SimEngineConfig


@pytest.fixture(scope="module")
def sim_process(tiny_model_dir, tmp_path_factory):
    eps = tmp_path_factory.mktemp("sim") / "endpoints.yaml"
    log = open(eps.parent / "sim.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "sim",
            "--num-instances",
            "3",
            "--base-port",
            "0",
            "--kv-events-base-port",
            "0",
            "--model",
            str(tiny_model_dir),
            "--preset",
            "cpu-tiny",
            "--time-scale",
            "0.05",
            "--num-kv-blocks",
            "256",
            "--max-model-len",
            "1024",
            "--write-endpoints",
            str(eps),
            "--oracle-port",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not eps.exists():
            assert proc.poll() is None, (eps.parent / "sim.log").read_text()
            assert time.monotonic() < deadline, "kvserve sim did not start"
            time.sleep(0.1)
        yield proc, yaml.safe_load(eps.read_text())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def test_serves_completions_and_vllm_metrics(sim_process):
    _, doc = sim_process
    eps = doc["endpoints"]
    assert len(eps) == 3 and len({e["url"] for e in eps}) == 3
    with httpx.Client(timeout=30) as c:
        for e in eps:
            body = {"model": e["model"], "prompt": list(range(50, 98)), "max_tokens": 5}
            r = c.post(e["url"] + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            data = r.json()
            assert data["usage"]["prompt_tokens"] == 48
            assert data["usage"]["completion_tokens"] == 5
            assert data["choices"][0]["finish_reason"] == "length"
        url, model = eps[0]["url"], eps[0]["model"]
        r = c.post(
            url + "/v1/completions",
            json={"model": model, "prompt": "hello there world", "max_tokens": 3},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        # The same prompt again hits the prefix cache (2 of its 3 blocks: 1 token recomputed).
        body = {"model": model, "prompt": list(range(50, 98)), "max_tokens": 2}
        again = c.post(url + "/v1/completions", json=body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        bad = c.post(url + "/v1/completions", json={"model": model, "prompt": [10**9]})
        assert bad.status_code == 400
        text = c.get(url + "/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
    ):
        assert name in text, name
    hits = [ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total")]
    assert float(hits[0].split()[-1]) >= 32


def test_publishes_kv_events_on_zmq(sim_process):
    _, doc = sim_process
    ep = doc["endpoints"][1]
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep["kv_events"])
    try:
        time.sleep(0.3)  # the subscription reaches the publisher
        prompt = list(range(200, 264))  # 4 full blocks
        with httpx.Client(timeout=30) as c:
            r = c.post(
                ep["url"] + "/v1/completions",
                json={"model": ep["model"], "prompt": prompt, "max_tokens": 1},
            )
            assert r.status_code == 200
        stored: list[BlockStored] = []
        topic = None
        deadline = time.monotonic() + 10
        while sum(len(e.block_hashes) for e in stored) < 3 and time.monotonic() < deadline:
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert len(seq) == 8
                stored += [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
        port = ep["url"].rsplit(":", 1)[1]
        assert topic is not None and topic.decode().startswith(f"kv@127.0.0.1:{port}@")
        assert stored and all(e.medium == "GPU" and e.block_size == 16 for e in stored)
        tokens = [t for e in stored for t in e.token_ids]
        assert tokens[:48] == prompt[:48]
    finally:
        sub.close()


def test_oracle_router_serves_and_names_the_instance(sim_process):
    _, doc = sim_process
    names = {e["name"] for e in doc["endpoints"]}
    with httpx.Client(timeout=30) as c:
        model = doc["endpoints"][0]["model"]
        served = set()
        for i in range(4):
            body = {"model": model, "prompt": list(range(300 + i, 340 + i)), "max_tokens": 2}
            r = c.post(doc["oracle"] + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            served.add(r.headers["x-kvserve-endpoint"])
    assert served <= names


def test_sigint_stops_the_process_cleanly(sim_process):
    proc, _ = sim_process
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == 0


def test_many_instances_in_one_loop(tiny_model_dir):
    cfg = SimEngineConfig(
        model=str(tiny_model_dir),
        sim_latency="cpu-tiny",
        sim_time_scale=0.05,
        num_kv_blocks=64,
        max_model_len=512,
    )
    cluster = SimCluster.build(8, cfg, ServerConfig(host="127.0.0.1", port=0))
    threads_before = threading.active_count()

    async def main() -> list[int]:
        await cluster.start()
        try:
            async with httpx.AsyncClient(timeout=30) as c:
                reqs = [
                    c.post(
                        inst.url + "/v1/completions",
                        json={
                            "model": inst.engine.model_name,
                            "prompt": [5, 6, 7, i],
                            "max_tokens": 4,
                        },
                    )
                    for i, inst in enumerate(cluster.instances)
                    for _ in range(2)
                ]
                return [r.status_code for r in await asyncio.gather(*reqs)]
        finally:
            await cluster.stop()

    codes = asyncio.run(main())
    assert codes == [200] * 16
    assert all(inst.engine.get_stats().num_running == 0 for inst in cluster.instances)
    assert all(not inst.async_engine.is_alive for inst in cluster.instances)
    assert threading.active_count() <= threads_before
