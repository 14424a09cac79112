"""Data-parallel ranks with expert parallelism, as real processes: `kvserve serve
--data-parallel-size 2 --enable-expert-parallel` on tiny-moe. Greedy outputs equal one process
serving the whole model and transformers, with requests on both ranks at once and with one
rank idle while the other decodes; each rank is an endpoint (own port, the
X-data-parallel-rank header on the first port, own KV events carrying its rank, own expert
metrics); a killed rank takes the group down with a non-zero exit."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from kvserve import LLM
from kvserve.bench.loadgen import wait_for_server
from kvserve.bench.ports import free_port_block
from kvserve.kv.events import decode_batch
from kvserve.model.presets import make_model
from tests.engine.test_llm_parity import MAX_TOKENS, HFOracle, _greedy, _prompts

REPO = Path(__file__).resolve().parents[2]
SERVER_ARGS = [
    "--served-model-name",
    "tiny-moe",
    "--num-kv-blocks",
    "64",
    "--max-model-len",
    "256",
    "--max-num-batched-tokens",
    "24",
    "--kv-offload-size",  # a host tier per rank
    "0.02",
]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("tiny-moe"), preset="tiny-moe"))


@pytest.fixture(scope="module")
def reference(moe_dir):
    """Greedy (token ids, text) of one process serving the whole model."""
    llm = LLM(moe_dir, num_kv_blocks=128, max_model_len=256)

    def run(prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
        params = dataclasses.replace(_greedy(), max_tokens=max_tokens)
        out = llm.generate([prompt], params)[0].outputs[0]
        return out.token_ids, out.text

    return run


class DPServer:
    def __init__(self, popen: subprocess.Popen, base: int, events: int, log: Path) -> None:
        self.popen, self.base, self.events, self.log = popen, base, events, log

    def url(self, rank: int) -> str:
        return f"http://127.0.0.1:{self.base + rank}"

    def rank_pids(self) -> list[int]:
        path = Path(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children")
        return [int(p) for p in path.read_text().split()]


@pytest.fixture(scope="module")
def dp_server(moe_dir, tmp_path_factory):
    base = free_port_block("127.0.0.1", 2)
    events = free_port_block("127.0.0.1", 2)
    log = tmp_path_factory.mktemp("dp") / "serve.log"
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", moe_dir, *SERVER_ARGS]
    cmd += ["--port", str(base), "--data-parallel-size", "2", "--enable-expert-parallel"]
    cmd += ["--kv-events-endpoint", f"tcp://127.0.0.1:{events}"]
    with open(log, "wb") as f:
        popen = subprocess.Popen(
            cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = DPServer(popen, base, events, log)
    try:
        for rank in range(2):
            wait_for_server(server.url(rank), timeout=180, proc=popen)
        yield server
    finally:
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                for pid in server.rank_pids():
                    os.kill(pid, signal.SIGKILL)
                popen.wait()


def _text(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **headers: str) -> str:
    body = {"model": "tiny-moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_ep_ranks_match_one_process_and_hf_with_both_ranks_busy(dp_server, reference, moe_dir):
    prompts = _prompts(21, 6, 5, 70, 1000)
    prompts.append(prompts[5][:40] + [11, 12])  # a prefix-cache hit on the same rank
    jobs = [(dp_server.url(i % 2), p) for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _text(*j), jobs))
    for p, text in zip(prompts, got, strict=True):
        assert text == reference(p)[1]
    hf = HFOracle(moe_dir)
    for p in prompts[:3]:
        assert reference(p)[0] == hf.greedy(p)


def test_one_rank_idle_while_the_other_decodes(dp_server, reference):
    p = _prompts(22, 1, 30, 30, 1000)[0]
    want = reference(p, 40)[1]
    # Only rank 1 has work; rank 0 joins every MoE layer with empty steps.
    assert _text(dp_server.url(1), p, 40) == want
    # The same through rank 0's port and the X-data-parallel-rank header.
    assert _text(dp_server.url(0), p, 40, **{"X-data-parallel-rank": "1"}) == want


def test_bad_rank_header_is_an_openai_400(dp_server):
    r = httpx.post(
        f"{dp_server.url(0)}/v1/completions",
        json={"model": "tiny-moe", "prompt": "hi"},
        headers={"X-data-parallel-rank": "2"},
        timeout=30,
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == "X-data-parallel-rank"


def test_each_rank_publishes_its_events_and_expert_load(dp_server):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{dp_server.events + 1}")
    try:
        for seed in range(23, 53):  # new blocks until the subscription has joined
            _text(dp_server.url(1), _prompts(seed, 1, 40, 40, 1000)[0], 2)
            if sub.poll(1000):
                break
        assert sub.poll(0), "no KV event batch from rank 1"
        _topic, _seq, payload = sub.recv_multipart()
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 1
        assert msgspec.msgpack.decode(payload)[2] == 1  # vLLM's third field on the wire
    finally:
        sub.close(linger=0)
    metrics = httpx.get(f"{dp_server.url(1)}/metrics", timeout=30).text
    samples = [
        line for line in metrics.splitlines() if line.startswith("kvserve:moe_expert_tokens_total")
    ]
    assert len(samples) == 4 * 8  # layers x experts
    assert sum(float(line.rsplit(" ", 1)[1]) for line in samples) > 0
    assert "kvserve:moe_expert_load_imbalance{" in metrics


def test_router_indexes_and_routes_to_the_rank_holding_the_prefix(dp_server, tmp_path, moe_dir):
    from tests.cluster.processes import router_process

    base = dp_server.url(0)
    config = {
        "tokenizer": moe_dir,
        "endpoints": [
            {
                "url": base,
                "kv_events": f"tcp://127.0.0.1:{dp_server.events}",
                "data_parallel_size": 2,
            }
        ],
    }
    prefix = _prompts(24, 1, 96, 96, 1000)[0]
    with router_process(tmp_path, config) as router:

        def kv_blocks() -> dict[str, int]:
            state = httpx.get(f"{router}/router/state", timeout=30).json()
            return {e["name"]: e["kv_blocks"] for e in state["endpoints"]}

        assert set(kv_blocks()) == {f"{base}/dp0", f"{base}/dp1"}
        deadline = time.monotonic() + 60
        while kv_blocks()[f"{base}/dp1"] < 6:  # rank 1's events reach the router's index
            assert time.monotonic() < deadline, kv_blocks()
            _text(dp_server.url(1), prefix, 1)  # again until the router has subscribed
            time.sleep(0.5)
        assert kv_blocks()[f"{base}/dp0"] == 0
        for i in range(3):
            body = {"model": "tiny-moe", "prompt": prefix + [7 + i], "max_tokens": 1}
            r = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvserve-endpoint"] == f"{base}/dp1"


def test_killed_rank_takes_the_group_down(dp_server):
    ranks = dp_server.rank_pids()
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    assert dp_server.popen.wait(timeout=60) == 1
    assert "rank 1 killed by SIGKILL" in dp_server.log.read_text()
    for pid in ranks:
        with pytest.raises(ProcessLookupError):
            for _ in range(100):  # reaped by the supervisor: gone
                os.kill(pid, 0)
                time.sleep(0.1)


def test_independent_replicas_serve_and_stop_cleanly(tiny_model_dir):
    """Without expert parallelism: N independent engines (here a dense model), one port
    each; SIGTERM to the supervisor stops every rank and exits 0."""
    base = free_port_block("127.0.0.1", 2)
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tiny_model_dir)]
    cmd += ["--served-model-name", "tiny-moe", "--num-kv-blocks", "64", "--max-model-len", "256"]
    cmd += ["--port", str(base), "--data-parallel-size", "2"]
    popen = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    server = DPServer(popen, base, 0, Path("/dev/null"))
    try:
        for rank in range(2):
            wait_for_server(server.url(rank), timeout=180, proc=popen)
        ranks = server.rank_pids()
        p = _prompts(25, 1, 20, 20, 1000)[0]
        assert _text(server.url(0), p) == _text(server.url(1), p)
        assert "moe_expert" not in httpx.get(f"{server.url(1)}/metrics", timeout=30).text
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(timeout=60) == 0
        for pid in ranks:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


def test_expert_parallel_refuses_a_dense_model(tiny_model_dir):
    r = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tiny_model_dir)]
        + ["--data-parallel-size", "2", "--enable-expert-parallel"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "needs a mixture-of-experts model" in r.stderr


def test_router_config_expands_a_data_parallel_server_into_rank_endpoints():
    from kvserve.cluster.cli import parse_endpoint_flag
    from kvserve.cluster.config import ConfigError, router_config_from_dict

    cfg = router_config_from_dict(
        {
            "endpoints": [
                {
                    "url": "http://10.0.0.1:8000",
                    "name": "a",
                    "kv_events": "tcp://10.0.0.1:5557",
                    "kv_events_replay": "tcp://10.0.0.1:5600",
                    "data_parallel_size": 3,
                },
                {"url": "http://10.0.0.2:8000"},
            ]
        }
    ).validate()
    got = [
        (e.key, e.url, e.kv_events, e.kv_events_replay, e.data_parallel_rank) for e in cfg.endpoints
    ]
    assert got == [
        ("a/dp0", "http://10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5600", 0),
        ("a/dp1", "http://10.0.0.1:8001", "tcp://10.0.0.1:5558", "tcp://10.0.0.1:5601", 1),
        ("a/dp2", "http://10.0.0.1:8002", "tcp://10.0.0.1:5559", "tcp://10.0.0.1:5602", 2),
        ("http://10.0.0.2:8000", "http://10.0.0.2:8000", None, None, None),
    ]
    spec = parse_endpoint_flag("http://h:9000,events=tcp://h:7000,dp=2")
    assert spec.data_parallel_size == 2
    with pytest.raises(ConfigError, match="explicit port"):
        router_config_from_dict(
            {"endpoints": [{"url": "http://h", "data_parallel_size": 2}]}
        ).validate()


def test_cpu_ranks_split_the_cores_unless_threads_are_given():
    """Each CPU rank gets ``cores // size`` torch threads (prefill steps too: the flag pins
    both counts); a user's ``--num-threads`` and a single rank are left alone."""
    from kvserve.config import EngineConfig
    from kvserve.cpu import usable_cores
    from kvserve.server.data_parallel import rank_argv

    def threads(argv: list[str]) -> str | None:
        return argv[argv.index("--num-threads") + 1] if "--num-threads" in argv else None

    cpu = EngineConfig(model="m", device="cpu")
    assert threads(rank_argv(["serve"], 1, 8001, 9000, cpu, 2)) == str(max(1, usable_cores() // 2))
    assert threads(rank_argv(["serve"], 0, 8000, 9000, cpu, 1)) is None
    given = EngineConfig(model="m", device="cpu", num_threads=3)
    assert threads(rank_argv(["serve", "--num-threads", "3"], 0, 8000, 9000, given, 2)) == "3"
    assert (
        threads(rank_argv(["serve"], 0, 8000, 9000, EngineConfig(model="m", device="cuda"), 2))
        is None
    )
