"""The router as an Endpoint Picker behind a real Envoy: Envoy -> `kvserve route --epp` -> two
real `kvserve serve` engines (tiny model). One cluster per module; the HTTP router of the
local cluster runs beside the EPP on the same engines (both index their KV events), so the
two front ends of the one scheduling core can be compared. Tests run in file order: the last
ones kill engines."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.bench.envoy import Envoy, EnvoySpec
from kvserve.bench.local_cluster import ClusterSpec, LocalCluster, free_port
from kvserve.cluster.config import EndpointSpec, HealthConfig, RouterConfig
from kvserve.cluster.epp.server import EXT_PROC_SERVICE, EndpointPicker
from kvserve.cluster.gateway import Router
from kvserve.cluster.headers import SUBSET_KEY
from tests.cluster.processes import fake_backends, router_process

pytestmark = pytest.mark.slow
KEY = "sk-epp-client"  # the clients' key; the engines have their own, only the pickers hold it
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EppProcess:
    """`kvserve route --epp-port P` on the cluster's engines; restartable on the same port."""

    def __init__(self, cluster: LocalCluster, tmp: Path) -> None:
        argv = list(cluster.router.popen.args)  # the cluster router's own endpoint flags
        self.args = ["--tokenizer", cluster.spec.model_dir]
        for i, a in enumerate(argv):
            if a == "--endpoint":
                self.args += ["--endpoint", argv[i + 1]]
        self.grpc_port = free_port()
        self.env = {"KVSERVE_API_KEY": KEY, "KVSERVE_UPSTREAM_API_KEY": cluster.engine_api_key}
        self.tmp = tmp
        self._stack: contextlib.ExitStack | None = None
        self.url = ""

    def start(self) -> None:
        self._stack = contextlib.ExitStack()
        self.url = self._stack.enter_context(
            router_process(
                self.tmp, {}, *self.args, "--epp-port", str(self.grpc_port), env=self.env
            )
        )

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def state(self) -> dict[str, dict]:
        r = httpx.get(self.url + "/router/state", headers=AUTH, timeout=10, trust_env=False)
        return {e["name"]: e for e in r.json()["endpoints"]}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[LocalCluster, EppProcess, Envoy]]:
    tmp = tmp_path_factory.mktemp("epp")
    spec = ClusterSpec(
        model_dir=str(tiny_model_dir),
        num_engines=2,
        engine_args=["--num-kv-blocks", "256", "--num-threads", "1"],
        log_dir=str(tmp),
        api_key=KEY,
    )
    with LocalCluster(spec) as cluster:
        epp = EppProcess(cluster, tmp)
        epp.start()
        try:
            with Envoy(EnvoySpec(("127.0.0.1", epp.grpc_port)), tmp) as envoy:
                yield cluster, epp, envoy
        finally:
            epp.stop()


def _complete(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        json=body,
        headers={**AUTH, **(headers or {})},
        timeout=60,
        trust_env=False,
    )


def _served(r: httpx.Response) -> tuple[str, int]:
    assert r.status_code == 200, r.text
    # Envoy's report of the served address is for the EPP: removed before the client
    assert "x-gateway-destination-endpoint-served" not in r.headers
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return r.headers["x-kvserve-endpoint"], details.get("cached_tokens", 0)


@contextlib.contextmanager
def _epp_behind_envoy(
    tmp_path: Path, config: dict, *router_args: str, **spec: Any
) -> Iterator[tuple[str, Envoy]]:
    """An EPP (``kvserve route --epp-port``) for ``config`` behind a real Envoy built from
    ``EnvoySpec(epp, **spec)``: (the EPP's HTTP URL, the Envoy)."""
    grpc_port = free_port()
    with (
        router_process(tmp_path, config, *router_args, "--epp-port", str(grpc_port)) as epp,
        Envoy(EnvoySpec(("127.0.0.1", grpc_port), **spec), tmp_path) as envoy,
    ):
        yield epp, envoy


def _endpoints(epp: str) -> list[dict]:
    """The EPP's view of its endpoints (its ``/router/state``)."""
    return httpx.get(epp + "/router/state", timeout=10, trust_env=False).json()["endpoints"]


def _metrics_once_streams_end(epp: str, timeout: float = 10.0) -> str:
    """The EPP's ``/metrics`` once no ext_proc stream is open, or at ``timeout`` (observed
    responses: Envoy ends the observer streams ``deferred_close_timeout`` after their
    requests)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(epp + "/metrics", timeout=10, trust_env=False).text
        if "kvserve_router_epp_streams 0.0" in text or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def _health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_health_services_serving_once_synced(stack):
    _, epp, _ = stack
    for service in ("liveness", "readiness", EXT_PROC_SERVICE, ""):
        assert _health(epp.grpc_port, service) == SERVING


def test_readiness_waits_for_the_endpoint_view(tmp_path):
    """In process, real sockets: an endpoint that accepts but does not answer keeps the
    first health round (and so readiness) pending; liveness is SERVING from the start.
    Once the endpoint drops its connections the round ends and readiness is SERVING."""

    async def run() -> None:
        held: list[asyncio.StreamWriter] = []
        drop = False

        def accept(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            if drop:
                w.close()  # (a client may retry a GET on a new connection)
            else:
                held.append(w)

        silent = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        cfg = RouterConfig(
            port=0,
            endpoints=[EndpointSpec(url=f"http://127.0.0.1:{port}", model="m")],
            health=HealthConfig(timeout_s=120.0),
        )
        epp = EndpointPicker(Router(cfg), port=0)
        starting = asyncio.create_task(epp.start())
        while not epp.port:
            await asyncio.sleep(0.02)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            async def status(s: str) -> int:
                req = health_pb2.HealthCheckRequest(service=s)
                r = await stub.Check(req, timeout=30, wait_for_ready=True)
                return r.status

            assert await status("liveness") == SERVING
            assert await status("readiness") == NOT_SERVING
            assert await status(EXT_PROC_SERVICE) == NOT_SERVING
            while not held:  # the health check's connection
                await asyncio.sleep(0.02)
            assert not starting.done()
            drop = True
            for w in held:
                w.close()  # the check fails now: the view is synced (endpoint unhealthy)
            await asyncio.wait_for(starting, 60)
            assert await status("readiness") == SERVING
            assert await status(EXT_PROC_SERVICE) == SERVING
        await epp.stop()
        silent.close()

    asyncio.run(run())


def test_sessions_land_where_their_prefix_is_as_through_the_http_router(stack):
    cluster, _, envoy = stack
    rng = random.Random(1)
    sessions = [[rng.randrange(10, 2000) for _ in range(96)] for _ in range(8)]
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    first = {
        i: _served(_complete(envoy.url, {**body, "prompt": p}))[0] for i, p in enumerate(sessions)
    }
    assert len(set(first.values())) == 2, "cold sessions should spread over both engines"
    time.sleep(1.0)  # KV events reach both indexes
    for i, p in enumerate(sessions):
        turn2 = p + [rng.randrange(10, 2000) for _ in range(20)]
        endpoint, cached = _served(_complete(envoy.url, {**body, "prompt": turn2}))
        assert endpoint == first[i], f"session {i} moved from {first[i]} to {endpoint}"
        assert cached >= 80  # 5 of its 6 full blocks
        # The HTTP router (same core, its own process) sends the next turn to the same engine.
        turn3 = turn2 + [rng.randrange(10, 2000) for _ in range(20)]
        r = _complete(cluster.router_url, {**body, "prompt": turn3})
        assert _served(r)[0] == first[i]


def test_keys_the_picker_checks_and_the_engines_own_key_it_sends(stack):
    """As the HTTP router: the clients' key at the picker (401 before any pick), the engines
    reached with their own key (the clients' would be refused there)."""
    cluster, _, envoy = stack
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(envoy.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(cluster.engine_urls[0] + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 401  # the clients' key does not open an engine
    assert _complete(envoy.url, body).status_code == 200


def test_bad_json_gets_an_openai_error_from_the_picker(stack):
    _, _, envoy = stack
    r = httpx.post(envoy.url + "/v1/completions", content=b'{"model": ', headers=AUTH, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in r.json()["error"]["message"]


def _stream(url: str, body: dict) -> tuple[list[bytes], int]:
    """The SSE events of a streamed completion, and how many reads the client made."""
    data, reads = b"", 0
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60, trust_env=False
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for piece in r.iter_raw():
            reads += 1
            data += piece
    return [ln for ln in data.split(b"\n") if ln.startswith(b"data: ")], reads


def _ext_proc_messages(envoy: Envoy) -> tuple[int, int]:
    """Envoy's ext_proc messages so far: sent to the EPP, received from it."""
    st = envoy.stats("http.epp.ext_proc.")
    return st["http.epp.ext_proc.stream_msgs_sent"], st["http.epp.ext_proc.stream_msgs_received"]


def test_streaming_arrives_token_by_token(stack):
    """Every event of an engine's stream through Envoy (that each is relayed as it comes,
    not gathered, is checked on a slow stream below: a tiny engine's events can coalesce in
    one read of a client slower than the engine). The stream's events do not pass through
    the EPP (three messages each way for the whole request, none per event), and its count
    is released at its end, when Envoy ends the ext_proc stream."""
    _, epp, envoy = stack
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 24, "stream": True}
    body.update(temperature=0, ignore_eos=True, stream_options={"include_usage": True})
    sent, received = _ext_proc_messages(envoy)
    events, reads = _stream(envoy.url, body)
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 24
    # An event per step (a loaded engine merges the tokens of steps its stream lagged on).
    assert len(events) >= 6 and reads >= 1
    deadline = time.monotonic() + 30
    while any(e["in_flight"] for e in epp.state().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(e["in_flight"] == 0 for e in epp.state().values())
    after = _ext_proc_messages(envoy)
    assert (after[0] - sent, after[1] - received) == (3, 3)  # BUFFERED, the body skipped


def test_a_1mb_body_passes_intact(stack):
    """1 MB of token ids: the engine counts every one of them, exactly as when asked directly."""
    cluster, _, envoy = stack
    rng = random.Random(2)
    ids = [rng.randrange(100000, 999999) for _ in range(140_000)]
    data = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 1}).encode()
    assert len(data) >= 1 << 20
    headers = {"content-type": "application/json"}
    via = httpx.post(
        envoy.url + "/v1/completions", content=data, headers={**headers, **AUTH}, timeout=60
    )
    engine_auth = {"Authorization": f"Bearer {cluster.engine_api_key}"}
    direct = httpx.post(
        cluster.engine_urls[0] + "/v1/completions",
        content=data,
        headers={**headers, **engine_auth},
        timeout=60,
    )
    assert via.status_code == direct.status_code == 400
    assert via.json() == direct.json()
    assert f"has {len(ids)} tokens" in via.json()["error"]["message"]


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "STREAMED"])
def test_the_other_body_modes(stack, tmp_path, mode):
    """Envoy streaming the body both ways (the extension's full-duplex mode: the body is
    echoed) or streaming it while the headers wait: the same answers as the buffered mode
    the harness and the deployed gateway use (the pick rides on the body response)."""
    _, epp, _ = stack
    with Envoy(EnvoySpec(("127.0.0.1", epp.grpc_port), request_body_mode=mode), tmp_path) as e:
        body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 2}
        assert _served(_complete(e.url, body))[0] in epp.state()
        ids = list(range(100000, 240000))
        r = _complete(e.url, {"model": "tiny", "prompt": ids, "max_tokens": 1})
        assert r.status_code == 400 and f"has {len(ids)} tokens" in r.json()["error"]["message"]
        r = httpx.post(e.url + "/v1/completions", content=b"[1, 2", headers=AUTH, timeout=30)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_subset_hint_is_honoured(stack):
    cluster, epp, envoy = stack
    names = {e["url"].removeprefix("http://"): n for n, e in epp.state().items()}
    prompt = [random.Random(3).randrange(10, 2000) for _ in range(64)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    home = _served(_complete(envoy.url, body))[0]
    time.sleep(0.5)
    other = next(a for a, n in names.items() if n != home)
    for _ in range(3):  # the prefix is on `home`, the hint allows only `other`
        r = _complete(envoy.url, body, headers={SUBSET_KEY: other})
        assert _served(r)[0] == names[other]
    r = _complete(envoy.url, body, headers={SUBSET_KEY: "10.255.255.1:1"})
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize(
    "modes",
    [
        ("BUFFERED", "STREAMED", "SEND", "exchange"),
        ("STREAMED", "NONE", "SEND", "exchange"),
        ("BUFFERED", "NONE", "SKIP", "exchange"),
        ("BUFFERED", "NONE", "SKIP", "observe"),
    ],
    ids=["buffered", "response-none", "response-headers-skipped", "observed"],
)
def test_streams_hold_their_count_then_shed_then_release_on_disconnect(tmp_path, modes):
    """A stream counts while it runs (not only until its headers); with every endpoint at
    its limit (here 1 request, no queue) the EPP answers 429; a client that goes away
    releases its count. Slow-streaming fake backends: a tiny engine finishes too soon.
    With the response body never sent to the EPP (NONE) Envoy would end the ext_proc stream
    at the response headers: the harness asks for trailers to keep it open to the end; with
    the response headers skipped too, the trailers are the EPP's only news of the answer.
    Observed (the response reported by an observer filter): the picking stream, which sees
    nothing of the response, lasts as long as the HTTP request without trailers."""
    with fake_backends(2) as urls:
        for u in urls:
            httpx.post(u + "/_fake/config", json={"chunks": 200, "chunk_interval": 0.05})
        config = {"endpoints": [{"url": u} for u in urls]}
        limits = ["--max-connections-per-endpoint", "1", "--max-queue-per-endpoint", "0"]
        with _epp_behind_envoy(
            tmp_path,
            config,
            *limits,
            request_body_mode=modes[0],
            response_body_mode=modes[1],
            response_header_mode=modes[2],
            response_path=modes[3],
        ) as (epp, envoy):

            def in_flight() -> list[int]:
                return sorted(e["in_flight"] for e in _endpoints(epp))

            body = {"model": "m", "prompt": "hi", "stream": True}
            with contextlib.ExitStack() as streams:
                readers = []  # alive: a dropped iterator closes its response
                for _ in range(2):
                    r = streams.enter_context(
                        httpx.stream("POST", envoy.url + "/v1/completions", json=body, timeout=60)
                    )
                    assert r.status_code == 200
                    readers.append(r.iter_raw())
                    t0 = time.monotonic()
                    assert next(readers[-1]).startswith(b"data: ")  # 200 events, one per 50 ms
                    assert time.monotonic() - t0 < 5  # not held until the stream's end (10 s)
                # Both still run (10 s each): the first events were relayed as they came.
                assert in_flight() == [1, 1]  # one on each (the first is at its limit)
                r = _complete(envoy.url, {"model": "m", "prompt": "x", "max_tokens": 2})
                assert r.status_code == 429
                assert r.json()["error"]["type"] == "rate_limit_exceeded"
                assert r.headers["retry-after"] == "1"
            deadline = time.monotonic() + 30  # the clients went away mid-stream
            while in_flight() != [0, 0] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert in_flight() == [0, 0]
            metrics = _metrics_once_streams_end(epp)
            assert 'kvserve_router_rejected_total{status="429"} 1.0' in metrics
            assert "kvserve_router_epp_streams 0.0" in metrics


def test_without_the_response_headers_exchange_an_answer_counts_until_its_end(tmp_path):
    """Envoy skipping the response headers (body NONE, trailers asked for: the harness's
    envoy_epp_trailers arm) ends the ext_proc stream only with the answer: a slow answer
    with a length holds its count until it is complete, then releases it; 2 messages each
    way, the answer unchanged (no x-kvserve-endpoint: nothing went through the EPP)."""
    with fake_backends(2) as urls:
        for u in urls:
            httpx.post(u + "/_fake/config", json={"delay": 1.5})
        config = {"endpoints": [{"url": u} for u in urls]}
        with _epp_behind_envoy(tmp_path, config, response_path="trailers") as (epp, envoy):

            def in_flight() -> int:
                return sum(e["in_flight"] for e in _endpoints(epp))

            sent, received = _ext_proc_messages(envoy)
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(_complete, envoy.url, body)
                time.sleep(0.8)  # picked, the backend still waiting
                assert in_flight() == 1
                r = answer.result(timeout=30)
            assert r.status_code == 200 and "x-kvserve-endpoint" not in r.headers
            deadline = time.monotonic() + 10
            while in_flight() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert in_flight() == 0
            after = _ext_proc_messages(envoy)
            assert (after[0] - sent, after[1] - received) == (2, 2)


def test_the_grpcio_transport(tmp_path):
    """`--epp-transport grpcio` (grpc.aio instead of the in-loop server) keeps the contract:
    gRPC health, a pick through Envoy, the served endpoint named, its count released."""
    with fake_backends(2) as urls:
        config = {"endpoints": [{"url": u} for u in urls]}
        with _epp_behind_envoy(tmp_path, config, "--epp-transport", "grpcio") as (epp, envoy):
            assert _health(envoy.spec.epp_address[1], "readiness") == SERVING
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            r = httpx.post(envoy.url + "/v1/completions", json=body, timeout=30, trust_env=False)
            assert r.status_code == 200, r.text
            endpoints = _endpoints(epp)
            assert r.headers["x-kvserve-endpoint"] in {e["name"] for e in endpoints}
            deadline = time.monotonic() + 10  # (released as Envoy ends the picking stream)
            while any(e["in_flight"] for e in endpoints):
                assert time.monotonic() < deadline
                time.sleep(0.05)
                endpoints = _endpoints(epp)


def test_envoy_recovers_when_the_picker_restarts(stack):
    _, epp, envoy = stack
    body = {"model": "tiny", "prompt": [9, 10, 11], "max_tokens": 2}
    epp.stop()
    r = _complete(envoy.url, body)
    assert r.status_code >= 500  # fail closed while it is down
    epp.start()  # same gRPC port
    deadline = time.monotonic() + 60
    while True:
        r = _complete(envoy.url, body)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    assert _health(epp.grpc_port, "readiness") == SERVING


def test_a_killed_engine_is_no_longer_picked_and_nothing_leaks(stack):
    cluster, epp, envoy = stack
    victim = cluster.engines[0]
    os.killpg(victim.popen.pid, signal.SIGKILL)
    victim.popen.wait()
    deadline = time.monotonic() + 60
    while epp.state()[victim.name]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not epp.state()[victim.name]["healthy"]
    rng = random.Random(4)
    for _ in range(8):
        body = {"model": "tiny", "prompt": [rng.randrange(10, 2000) for _ in range(40)]}
        r = _complete(envoy.url, {**body, "max_tokens": 2})
        assert _served(r)[0] != victim.name
    assert all(e["in_flight"] == 0 for e in epp.state().values())


def test_no_ready_endpoint_gives_503_with_a_clear_body(stack):
    cluster, epp, envoy = stack
    for p in cluster.engines:
        if p.popen.poll() is None:
            os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait()
    deadline = time.monotonic() + 60
    while any(e["healthy"] for e in epp.state().values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    r = _complete(envoy.url, {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and err["message"]
    assert r.headers.get("retry-after") == "1"


def _metric(text: str, name: str, **labels: str) -> float:
    """A sample's value in Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    head = f"{name}{{{want}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(head + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_observed_responses_the_response_path_waits_for_no_epp(tmp_path):
    """``response_path="observe"``: the picking stream sees the request only; a second ext_proc
    filter in Envoy's observability mode reports the response headers, found by the pick's id.
    The client gets x-kvserve-endpoint (from the pick's metadata, by Envoy) and not the served
    address; the EPP learns the endpoint that served (its status metrics by endpoint), holds
    the count until the answer ends (a slow answer with a length, a stream, a client gone
    mid-stream) and releases it then; 2 messages each way on the picking stream, 1 report and
    no answer on the observer's."""
    with fake_backends(2) as urls:
        config = {"endpoints": [{"url": u, "name": f"fake-{i}"} for i, u in enumerate(urls)]}
        with _epp_behind_envoy(tmp_path, config, response_path="observe") as (epp, envoy):

            def state() -> dict[str, dict]:
                return {e["name"]: e for e in _endpoints(epp)}

            def in_flight() -> int:
                return sum(e["in_flight"] for e in state().values())

            def metrics() -> str:
                return httpx.get(epp + "/metrics", timeout=10, trust_env=False).text

            def settle(want: int = 0) -> None:
                deadline = time.monotonic() + 10
                while in_flight() != want and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert in_flight() == want

            sent, received = _ext_proc_messages(envoy)
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            names = set()
            for _ in range(4):
                r = httpx.post(envoy.url + "/v1/completions", json=body, timeout=30)
                assert r.status_code == 200, r.text
                assert "x-gateway-destination-endpoint-served" not in r.headers
                names.add(r.headers["x-kvserve-endpoint"])
            assert names <= {"fake-0", "fake-1"}
            settle()
            after = _ext_proc_messages(envoy)
            assert (after[0] - sent, after[1] - received) == (8, 8)  # request path only
            obs = envoy.stats("http.epp.ext_proc.observer.")
            assert obs["http.epp.ext_proc.observer.stream_msgs_sent"] == 4
            assert obs.get("http.epp.ext_proc.observer.stream_msgs_received", 0) == 0
            text = metrics()  # the reports arrived, each matched to its pick
            served = sum(
                _metric(text, "kvserve_router_requests_total", endpoint=n, status="200")
                for n in ("fake-0", "fake-1")
            )
            assert served == 4
            assert _metric(text, "kvserve_router_routing_decisions_total", reason="failover") == 0

            # A slow answer with a length holds its count until it is complete.
            for u in urls:
                httpx.post(u + "/_fake/config", json={"delay": 1.5})
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(
                    httpx.post, envoy.url + "/v1/completions", json=body, timeout=30
                )
                time.sleep(0.8)
                assert in_flight() == 1
                assert answer.result(timeout=30).status_code == 200
            settle()

            # A stream holds it until its last event; a client gone mid-stream releases it.
            for u in urls:
                httpx.post(
                    u + "/_fake/config", json={"delay": 0, "chunks": 20, "chunk_interval": 0.1}
                )
            stream = {**body, "stream": True}
            with httpx.stream("POST", envoy.url + "/v1/completions", json=stream, timeout=30) as r:
                assert r.headers["x-kvserve-endpoint"] in names | {"fake-0", "fake-1"}
                assert "x-gateway-destination-endpoint-served" not in r.headers
                pieces = r.iter_raw()
                assert next(pieces).startswith(b"data: ")
                assert in_flight() == 1
                rest = b"".join(pieces)
                assert rest.rstrip().endswith(b"data: [DONE]")
            settle()
            for u in urls:
                httpx.post(u + "/_fake/config", json={"chunks": 200, "chunk_interval": 0.05})
            with httpx.stream("POST", envoy.url + "/v1/completions", json=stream, timeout=30) as r:
                pieces = r.iter_raw()  # (alive: a dropped iterator closes the response)
                assert next(pieces).startswith(b"data: ")
                assert in_flight() == 1
            settle()  # the client went away 10 s before the stream's end
            assert "kvserve_router_epp_streams 0.0" in _metrics_once_streams_end(epp)


def test_observed_responses_envoys_own_5xx_probes_the_endpoint(tmp_path):
    """Observe mode: an engine that stops accepting connections between health checks (here
    a minute apart) is out as soon as Envoy answers 503 itself: the observer's report (Envoy's
    status, no served address) makes the EPP check it now. The client's 503 carries no
    served address."""
    with fake_backends(1) as live, contextlib.ExitStack() as victim_stack:
        victim = victim_stack.enter_context(fake_backends(1))
        config = {
            "endpoints": [{"url": victim[0], "name": "victim"}, {"url": live[0], "name": "live"}],
            "health": {"interval_s": 60, "unhealthy_after": 1},  # (one probe: out)
        }
        with _epp_behind_envoy(tmp_path, config, response_path="observe") as (epp, envoy):

            def healthy() -> dict[str, bool]:
                return {e["name"]: e["healthy"] for e in _endpoints(epp)}

            assert healthy() == {"victim": True, "live": True}
            victim_stack.close()  # its process is gone: connections refused
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            statuses = []
            for _ in range(8):  # until the pick is the victim (load spreads the picks)
                r = httpx.post(envoy.url + "/v1/completions", json=body, timeout=30)
                statuses.append(r.status_code)
                assert "x-gateway-destination-endpoint-served" not in r.headers
                if r.status_code == 503:
                    break
            assert statuses[-1] == 503, statuses
            deadline = time.monotonic() + 5  # (the next health round: a minute away)
            while healthy()["victim"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert healthy() == {"victim": False, "live": True}
            r = httpx.post(envoy.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.headers["x-kvserve-endpoint"] == "live"
