"""Endpoint discovery (kvserve/cluster/discovery.py) for real: a router whose endpoints file
(swapped the way a ConfigMap volume swaps it) changes starts and stops routing to real
`kvserve serve` engines; DNS discovery through the system resolver (``localhost``) and, with
a resolver the test controls, addresses coming and going with their event streams."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from kvserve.bench.local_cluster import ClusterSpec, LocalCluster
from kvserve.cluster.config import ConfigError, router_config_from_dict
from kvserve.cluster.discovery import DnsSource, FileSource, system_resolver
from kvserve.cluster.gateway import Router
from kvserve.kv.event_publisher import ZmqEventPublisher

from .fake_openai_backend import FakeBackend
from .processes import router_process
from .test_gateway import PROMPT, _stored, arun, post, start_router, until

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the file


def _swap(root: Path, version: str, text: str) -> None:
    """Publish ``text`` as ``root/endpoints.yaml`` the way the kubelet updates a ConfigMap
    volume: a new directory, then the ``..data`` symlink renamed over the old one."""
    (root / version).mkdir()
    (root / version / "endpoints.yaml").write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(version)
    os.replace(tmp, root / "..data")
    if not (root / "endpoints.yaml").is_symlink():
        (root / "endpoints.yaml").symlink_to("..data/endpoints.yaml")


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(
        model_dir=str(tiny_model_dir),
        num_engines=2,
        engine_args=["--num-kv-blocks", "256", "--num-threads", "1"],
        log_dir=str(tmp_path_factory.mktemp("discovery-logs")),
    )
    with LocalCluster(spec) as c:
        yield c


def _engine_flag(cluster: LocalCluster, i: int) -> str:
    """engine ``i``'s ``--endpoint`` text, as its cluster's router was given it."""
    argv = cluster.router.popen.args  # type: ignore[union-attr]
    flags = [argv[j + 1] for j, a in enumerate(argv) if a == "--endpoint"]
    return next(f for f in flags if f.endswith(f"name=engine{i}"))


def _served(client: httpx.Client, url: str, prompt: list[int]) -> tuple[str, int]:
    r = client.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    cached = (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return r.headers["x-kvserve-endpoint"], cached


def _state(client: httpx.Client, url: str) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in client.get(url + "/router/state").json()["endpoints"]}


def _wait(pred, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.1)


def test_a_router_follows_its_endpoints_file_onto_real_engines(engines, tmp_path, tiny_model_dir):
    root = tmp_path / "endpoints"
    root.mkdir()
    e0, e1 = _engine_flag(engines, 0), _engine_flag(engines, 1)
    _swap(root, "..v1", f"- {e0}\n")  # the --endpoint syntax, events and replay included
    config = {
        "endpoints_file": str(root / "endpoints.yaml"),
        "endpoints_file_poll_s": 0.1,
        "tokenizer": str(tiny_model_dir),
        "health": {"interval_s": 0.2, "metrics_interval_s": 0.2},
        "scheduler": {"picker": {"name": "round_robin"}},
    }
    prompts = [[10 + i] * 48 + list(range(100, 148)) for i in range(6)]
    with router_process(tmp_path, config) as url, httpx.Client(timeout=60, trust_env=False) as c:
        assert {_served(c, url, p)[0] for p in prompts[:3]} == {"engine0"}

        _swap(root, "..v2", f"- {e0}\n- {e1}\n")
        _wait(
            lambda: all(e["healthy"] for e in _state(c, url).values()) and len(_state(c, url)) == 2
        )
        assert {_served(c, url, p)[0] for p in prompts} == {"engine0", "engine1"}

        _swap(root, "..v3", f"endpoints:\n  - {e1}\n")
        _wait(lambda: set(_state(c, url)) == {"engine1"})
        # engine1's KV events reach the index: a repeated prompt is routed as cached.
        _wait(lambda: _state(c, url)["engine1"]["kv_blocks"] > 0)
        for p in prompts:
            assert _served(c, url, p)[0] == "engine1"
        assert _served(c, url, prompts[0])[1] >= 80

        _swap(root, "..v4", "- url: [broken\n")  # a bad file keeps the last good list
        time.sleep(0.5)
        assert set(_state(c, url)) == {"engine1"}


def test_endpoints_file_source_reads_mappings_flags_and_sees_same_mtime_rewrites(tmp_path):
    path = tmp_path / "eps.json"
    path.write_text('[{"url": "http://10.0.0.1:8000"}, "http://10.0.0.2:8000,role=decode"]')
    src = FileSource(str(path))
    specs = src.read()
    assert [s.url for s in specs] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert specs[1].role == "decode" and src.answered
    path.write_text('["http://10.0.0.5:8000,dp=2"]')
    assert [s.url for s in src.read()] == ["http://10.0.0.5:8000", "http://10.0.0.5:8001"]
    st = os.stat(path)
    path.write_text('[{"url": "http://10.0.0.3:8000"}, "http://10.0.0.4:8000,role=decode"]')
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime as before
    assert [s.url for s in asyncio.run(src.poll()) or []][0] == "http://10.0.0.3:8000"
    assert asyncio.run(src.poll()) is None  # unchanged
    with pytest.raises(ConfigError, match="bad option"):
        path.write_text('["http://10.0.0.1:8000,evnets=tcp://x:1"]')
        src.read()


# ----------------------------------------------------------------------------- DNS


def test_dns_of_localhost_through_the_system_resolver() -> None:
    async def main() -> None:
        a = await FakeBackend("a").start()
        router = await start_router([], endpoints_dns=[f"dns://localhost:{a.port},family=ipv4"])
        try:
            assert router.pool.synced
            assert list(router.pool.endpoints) == [a.url]  # http://127.0.0.1:PORT
            await until(lambda: router.pool.endpoints[a.url].healthy)
            async with aiohttp.ClientSession() as s:
                status, _, served = await post(s, router, {"model": "m", "prompt": "hi"})
            assert status == 200 and served == a.url
            assert "127.0.0.1" in await system_resolver("localhost")
            with pytest.raises(socket.gaierror):
                await system_resolver("no-such-name.invalid")
        finally:
            await router.stop()
            await a.stop()

    arun(main)


def test_dns_addresses_come_and_go_with_their_event_streams() -> None:
    answers: list[Any] = [["127.0.0.1"]]
    calls: list[str] = []

    async def resolver(name: str, family: int) -> list[str]:
        assert name == "engines.llm.svc.cluster.local"
        calls.append(name)
        if len(calls) == 1:  # as a pod starts, its resolver may not answer yet
            raise socket.gaierror(socket.EAI_AGAIN, "temporary failure")
        answer = answers[-1]
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, asyncio.Event):
            await answer.wait()
        return list(answer)

    async def main() -> None:
        a = await FakeBackend("a").start()
        pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv@a@m")
        ev_port = pub.endpoint.rsplit(":", 1)[1]
        replay_port = pub.replay_endpoint.rsplit(":", 1)[1]
        target = (
            f"dns://engines.llm.svc.cluster.local:{a.port},"
            f"events=tcp://{{host}}:{ev_port},replay=tcp://{{host}}:{replay_port}"
        )
        cfg = {
            "endpoints_dns": [target],
            "endpoints_dns_poll_s": 0.05,
            "health": {"interval_s": 0.1, "timeout_s": 0.5, "metrics_interval_s": 0.1},
        }
        router = Router(router_config_from_dict(cfg))
        source = router.pool.sources[0]
        assert isinstance(source, DnsSource)
        source.resolver = resolver  # the system resolver's path: the localhost test
        await router.start(host="127.0.0.1", port=0)
        try:
            # start() asked again after the failure, then applied the first answer
            assert list(router.pool.endpoints) == [a.url] and len(calls) == 2
            assert router.pool.synced
            await until(lambda: router.pool.endpoints[a.url].healthy)
            pub.publish([_stored(PROMPT, 1)])
            await until(lambda: router.index.endpoint_num_blocks(a.url) == 6)

            answers.append(["127.0.0.2", "127.0.0.1"])  # a second pod (nothing listens there)
            other = f"http://127.0.0.2:{a.port}"
            await until(lambda: other in router.pool.endpoints)
            assert other in router.subscriber.all_stats()
            answers.append(socket.gaierror(socket.EAI_AGAIN, "temporary failure"))
            await asyncio.sleep(0.3)  # a failing resolver keeps the last answer
            assert set(router.pool.endpoints) == {a.url, other}
            source.timeout_s = 0.05
            answers.append(asyncio.Event())  # a resolver that never answers: the same
            await asyncio.sleep(0.5)
            assert set(router.pool.endpoints) == {a.url, other}
            answers.pop()
            source.timeout_s = 5.0  # (a hung lookup would have stopped the polls below)

            answers.append(["127.0.0.2"])  # the first pod is gone
            await until(lambda: a.url not in router.pool.endpoints)
            assert a.url not in router.subscriber.all_stats()
            assert router.index.endpoint_num_blocks(a.url) == 0
            async with aiohttp.ClientSession() as s:
                status, body, _ = await post(s, router, {"model": "m", "prompt": "x"})
            assert status == 503 and body["error"]["message"]

            answers.append(socket.gaierror(socket.EAI_NONAME, "no such name"))
            await until(lambda: not router.pool.endpoints)  # the Service has no pods
            answers.append(["127.0.0.1"])  # back: its stream is replayed from the start
            await until(lambda: router.index.endpoint_num_blocks(a.url) == 6)
        finally:
            await router.stop()
            await a.stop()
            pub.close()

    arun(main)


def _fixed(*addresses: str):
    async def resolver(name: str, family: int) -> list[str]:
        return list(addresses)

    return resolver


def test_dns_target_errors_ipv6_and_data_parallel_ranks() -> None:
    for bad, match in [
        ("engines:8000", "must start with dns://"),
        ("dns://:8000", "dns://NAME"),
        ("dns://e:8000,events=tcp://{pod}:1", "bad template"),
        ("dns://e:8000,evnets=tcp://{host}:1", "bad option"),
        ("dns://e:8000,family=ipv5", "family"),
    ]:
        with pytest.raises(ConfigError, match=match):
            DnsSource(bad)
    v6 = DnsSource("dns://e,events=tcp://{host}:5557,name=pod-{ip}").spec_for("fd00::1")
    assert v6.url == "http://[fd00::1]:8000" and v6.kv_events == "tcp://[fd00::1]:5557"
    assert v6.name == "pod-fd00::1"
    dp = DnsSource("dns://e:8000,events=tcp://{host}:5557,dp=2", resolver=_fixed("10.0.0.7"))
    ranks = asyncio.run(dp.poll()) or []
    assert [(s.url, s.kv_events, s.data_parallel_rank) for s in ranks] == [
        ("http://10.0.0.7:8000", "tcp://10.0.0.7:5557", 0),
        ("http://10.0.0.7:8001", "tcp://10.0.0.7:5558", 1),
    ]
    cmd = [sys.executable, "-m", "kvserve.cli", "route", "--endpoints-dns", "dns://e,bad=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "bad option" in out.stderr
