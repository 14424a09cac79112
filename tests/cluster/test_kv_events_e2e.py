"""KV events between real `kvserve serve` processes (tiny model) and a real `kvserve route`,
over CURVE: salted prefixes route by their digest (the raw salt is never on the wire), a
restarted router rebuilds its index from an idle cluster, and a restarted engine's blocks
leave the index without waiting for its next event."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from kvserve.bench.loadgen import wait_for_server
from kvserve.bench.local_cluster import ClusterSpec, LocalCluster
from kvserve.engine.hashing import salt_digest
from kvserve.kv.event_publisher import END_SEQ, pack_seq, unpack_seq

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE"),
]

BOUND_S = 30.0  # a loaded 2-core CI box: index changes are expected within a second or two


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("curve")
    out = {}
    for name in ("engine", "router", "sniffer"):
        public, secret = zmq.auth.create_certificates(d, name)
        out[name], out[name + ".pub"] = secret, public
    allowed = d / "allowed"
    allowed.mkdir()
    for name in ("router", "sniffer"):
        (allowed / f"{name}.key").write_bytes(Path(out[name + ".pub"]).read_bytes())
    out["allowed"] = str(allowed)
    return {k: str(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory, keys):
    spec = ClusterSpec(
        model_dir=str(tiny_model_dir),
        num_engines=2,
        engine_args=[
            "--num-kv-blocks", "256",
            "--num-threads", "1",
            "--kv-events-curve-secret-key", keys["engine"],
            "--kv-events-curve-allowed-clients", keys["allowed"],
        ],
        router_args=[
            "--kv-events-curve-client-key", keys["router"],
            "--kv-events-curve-server-key", keys["engine.pub"],
        ],
        log_dir=str(tmp_path_factory.mktemp("cluster-logs")),
    )  # fmt: skip
    with LocalCluster(spec) as c:
        yield c


def _flag(proc, name: str) -> str:
    args = list(proc.popen.args)
    return args[args.index(name) + 1]


def _client_socket(kind: int, keys: dict[str, str], name: str = "sniffer") -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.auth.load_certificate(keys[name])
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = zmq.auth.load_certificate(keys["engine.pub"])[0]
    return sock


def _replay_all(address: str, keys: dict[str, str]) -> list[list[bytes]]:
    dealer = _client_socket(zmq.DEALER, keys)
    dealer.connect(address)
    dealer.send_multipart((b"", pack_seq(0)))
    out = []
    try:
        while True:
            assert dealer.poll(10_000), "no replay answer"
            frames = dealer.recv_multipart()
            if unpack_seq(frames[2]) == END_SEQ:
                return out
            out.append(frames)
    finally:
        dealer.close()


def _state(cluster: LocalCluster) -> dict[str, int]:
    r = httpx.get(cluster.router_url + "/router/state", timeout=10, trust_env=False)
    return {e["name"]: e["kv_blocks"] for e in r.json()["endpoints"]}


def _wait(pred, what: str, timeout: float = BOUND_S) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def _complete(client: httpx.Client, url: str, prompt: list[int], salt: str | None = None):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    cached = (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return r.headers["x-kvserve-endpoint"], cached


def _respawn(cluster: LocalCluster, proc):
    """The same process again: same flags, ports and addresses."""
    new = cluster._spawn(proc.name + "-restarted", list(proc.popen.args[3:]), proc.url)
    return dataclasses.replace(new, name=proc.name)


def test_salted_prefixes_route_by_digest_and_the_salt_never_leaves_the_engine(cluster, keys):
    events = [_flag(p, "--kv-events-endpoint") for p in cluster.engines]
    replays = [_flag(p, "--kv-events-replay-endpoint") for p in cluster.engines]
    sniffer = _client_socket(zmq.SUB, keys)
    sniffer.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sniffer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    for address in events:
        sniffer.connect(address)
    for _ in events:
        assert monitor.poll(10_000)
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    # An unkeyed subscriber gets nothing at all.
    plain = zmq.Context.instance().socket(zmq.SUB)
    plain.setsockopt(zmq.LINGER, 0)
    plain.setsockopt(zmq.SUBSCRIBE, b"")
    for address in events:
        plain.connect(address)

    rng = random.Random(1)
    salts: list[str] = []
    prompts: list[list[int]] = []
    first: dict[str, str] = {}
    with httpx.Client(timeout=60, trust_env=False) as client:
        url = cluster.router_url
        # Cold sessions tie on every scorer and the picker breaks ties at random: at least
        # six, and as many more as it takes for both engines to hold some (1/32 of the time
        # six alone land on one engine).
        while len(salts) < 6 or len(set(first.values())) < 2:
            assert len(salts) < 40, "cold sessions should spread over both engines"
            salt = f"tenant-{len(salts)}-secret-{rng.randrange(10**9)}"
            prompt = [rng.randrange(10, 2000) for _ in range(96)]
            salts.append(salt)
            prompts.append(prompt)
            first[salt] = _complete(client, url, prompt, salt)[0]
        _wait(lambda: sum(_state(cluster).values()) >= 6 * 5, "salted blocks indexed")
        for salt, prompt in zip(salts, prompts, strict=True):
            turn2 = prompt + [rng.randrange(10, 2000) for _ in range(20)]
            endpoint, cached = _complete(client, cluster.router_url, turn2, salt)
            assert endpoint == first[salt], f"salted session moved ({salt})"
            assert cached >= 80  # 5 of its 6 full blocks
            # Another tenant with the same prompt shares nothing.
            _, cached = _complete(client, cluster.router_url, prompt, salt + "-other")
            assert cached == 0

    wire: list[bytes] = []
    while sniffer.poll(500):
        wire += sniffer.recv_multipart()
    for address in replays:
        for frames in _replay_all(address, keys):
            wire += frames
    assert not plain.poll(200)  # not one message without the keys
    sniffer.close()
    plain.close()
    monitor.close()
    blob = b"\0".join(wire)
    for salt in salts:
        assert salt_digest(salt).encode() in blob  # salted blocks were published ...
        assert salt.encode() not in blob  # ... but never the salt itself


def test_restarted_router_indexes_an_idle_cluster(cluster):
    before = _state(cluster)
    assert all(n > 0 for n in before.values()), before
    time.sleep(1.0)
    assert _state(cluster) == before  # idle: nothing is being published
    router = cluster.router
    os.killpg(router.popen.pid, signal.SIGTERM)
    router.popen.wait(30)
    cluster.router = _respawn(cluster, router)
    wait_for_server(cluster.router_url, timeout=120, proc=cluster.router.popen)
    # No request, no event: the replay made on subscribing fills the index.
    took = _wait(lambda: _state(cluster) == before, f"index back to {before}")
    print(f"router restart: index rebuilt {took:.2f} s after the router answered")


def test_restarted_engine_leaves_the_index(cluster):
    before = _state(cluster)
    victim = cluster.engines[0]
    assert before[victim.name] > 0
    os.killpg(victim.popen.pid, signal.SIGKILL)
    victim.popen.wait(30)
    time.sleep(0.5)
    assert _state(cluster)[victim.name] == before[victim.name]  # down is not restarted
    cluster.engines[0] = _respawn(cluster, victim)
    wait_for_server(victim.url, timeout=120, proc=cluster.engines[0].popen)
    # The new engine publishes nothing (it is idle): the reconnection's replay tells.
    took = _wait(lambda: _state(cluster)[victim.name] == 0, "restarted engine's blocks gone")
    print(f"engine restart: stale blocks cleared {took:.2f} s after the engine answered")
    other = cluster.engines[1].name
    assert _state(cluster)[other] == before[other]
    # And its new blocks are indexed again.
    with httpx.Client(timeout=60, trust_env=False) as client:
        r = client.post(
            victim.url + "/v1/completions",
            json={"model": "tiny", "prompt": list(range(40, 120)), "max_tokens": 2},
        )
        assert r.status_code == 200
    _wait(lambda: _state(cluster)[victim.name] > 0, "new blocks indexed")
