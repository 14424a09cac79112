"""P/D through the router, every process real: `kvserve route` in front of fake OpenAI backends
that emulate a prefill/decode pair (vLLM's ``kv_transfer_params`` contract), each backend in
its own process so that one can be killed. The legs' bodies, the decision (threshold, prefix
held on the decode side, saturated prefill pool), response headers, metrics and each failure
path: prefill down / erroring / slow / without parameters, decode down before the first byte,
client gone during either leg."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from kvserve.kv.event_publisher import ZmqEventPublisher
from kvserve.kv.events import BlockStored

from .processes import fake_backends, fake_config, fake_state, metric_samples, router_process

PROMPT = list(range(1000, 1100))  # 100 token ids (no tokenizer needed)
SHORT = list(range(2000, 2010))
THRESHOLD = 32


def until(pred: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not met in {timeout} s")
        time.sleep(0.05)


@contextlib.contextmanager
def backend(*args: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """One fake backend in its own process: (url, kill)."""
    with fake_backends(1, *args) as urls:
        yield urls[0], lambda: _kill_backend(urls[0])


def _kill_backend(url: str) -> None:
    """SIGKILL the process listening on ``url``'s port (found through /proc, our own child)."""
    port = int(url.rsplit(":", 1)[1])
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if int(parts[1].split(":")[1], 16) == port and parts[3] == "0A":  # LISTEN
                inode = parts[9]
    assert inode is not None, f"nothing listens on {port}"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    os.kill(int(pid), signal.SIGKILL)
                    until(lambda: not _listening(port), 10, "backend killed")
                    return
    raise AssertionError(f"no process of ours holds port {port}")


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def pd_router_config(
    prefill: list[str], decode: list[str], *, health_s: float = 0.2, **pd: Any
) -> dict[str, Any]:
    eps = [{"url": u, "name": f"prefill{i}", "role": "prefill"} for i, u in enumerate(prefill)]
    eps += [{"url": u, "name": f"decode{i}", "role": "decode"} for i, u in enumerate(decode)]
    return {
        "endpoints": eps,
        "health": {"interval_s": health_s, "timeout_s": 2.0, "metrics_interval_s": 0.2},
        "pd": {"threshold": THRESHOLD, **pd},
        "log_level": "info",
    }


def wait_all_healthy(url: str, n: int, headers: dict[str, str] | None = None) -> None:
    def ok() -> bool:
        r = httpx.get(url + "/router/state", headers=headers, trust_env=False, timeout=5)
        return sum(e["healthy"] for e in r.json()["endpoints"]) == n

    until(ok, 30, "endpoints healthy")


def post(url: str, body: dict, path: str = "/v1/completions", **kw: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=kw.pop("timeout", 60), trust_env=False, **kw)


def metrics(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return metric_samples(httpx.get(url + "/metrics", trust_env=False).text, name)


def pd_count(url: str, disaggregated: str, reason: str) -> float:
    key = (("disaggregated", disaggregated), ("reason", reason))
    return metrics(url, "kvserve_router_pd_decisions_total").get(key, 0.0)


def fallbacks(url: str) -> dict[str, float]:
    return {
        dict(k)["error"]: v for k, v in metrics(url, "kvserve_router_pd_fallbacks_total").items()
    }


def producer_params(prefill_url: str, n: int) -> dict[str, Any]:
    """What the fake prefill backend returns for its ``n``-th prefill leg."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine-b0",
        "remote_block_ids": [n * 10 + 1, n * 10 + 2],
        "remote_host": "127.0.0.1",
        "remote_port": int(prefill_url.rsplit(":", 1)[1]),
        "remote_request_id": f"prefill-b0-{n}",
    }


def prefill_leg_of(body: dict[str, Any]) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    if "min_tokens" in body:
        leg["min_tokens"] = min(body["min_tokens"], 1)
    return leg


def test_split_legs_bodies_headers_auth_and_metrics(tmp_path: Path) -> None:
    with (
        backend("--api-key", "engine-key") as (pre, _),
        backend("--api-key", "engine-key") as (dec, _),
    ):
        cfg = pd_router_config([pre], [dec])
        cfg["upstream_api_key"] = "engine-key"
        with router_process(tmp_path, cfg) as url:
            wait_all_healthy(url, 2)
            # Streaming completion: the prefill leg is not streamed, the decode leg is.
            body = {
                "model": "m",
                "prompt": PROMPT,
                "max_tokens": 7,
                "temperature": 0,
                "min_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
                "user": "u1",
            }
            with httpx.stream(
                "POST", url + "/v1/completions", json=body, timeout=60, trust_env=False
            ) as r:
                assert r.status_code == 200
                text = r.read().decode()
            assert "pulled from engine-b0" in text and text.rstrip().endswith("data: [DONE]")
            h = r.headers
            assert h["x-kvserve-disaggregated"] == "true"
            assert h["x-kvserve-pd-reason"] == "uncached_above_threshold"
            assert h["x-kvserve-prefill-endpoint"] == "prefill0"
            assert h["x-kvserve-decode-endpoint"] == "decode0" == h["x-kvserve-endpoint"]
            ps, ds = fake_state(pre), fake_state(dec)
            assert ps["requests"] == [prefill_leg_of(body)]
            assert ds["requests"] == [{**body, "kv_transfer_params": producer_params(pre, 1)}]
            assert ps["headers"][0]["Authorization"] == "Bearer engine-key"
            assert ds["headers"][0]["Authorization"] == "Bearer engine-key"

            # Chat, not streamed, untokenized text (~4 bytes a token): max_completion_tokens
            # becomes 1 on the prefill leg; the decode answer's kv_transfer_params pass through.
            chat = {
                "model": "m",
                "messages": [{"role": "user", "content": "tell me " * 30}],
                "max_completion_tokens": 9,
            }
            r = post(url, chat, "/v1/chat/completions")
            assert r.status_code == 200 and r.headers["x-kvserve-disaggregated"] == "true"
            assert r.json()["kv_transfer_params"] is None
            ps, ds = fake_state(pre), fake_state(dec)
            assert ps["requests"][1] == prefill_leg_of(chat)
            assert ds["requests"][1] == {**chat, "kv_transfer_params": producer_params(pre, 2)}

            # Short prompt: the decode endpoint serves alone, the client's body unchanged.
            short = {"model": "m", "prompt": SHORT, "max_tokens": 3}
            r = post(url, short)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "from b0"
            assert r.headers["x-kvserve-disaggregated"] == "false"
            assert r.headers["x-kvserve-pd-reason"] == "below_threshold"
            assert "x-kvserve-prefill-endpoint" not in r.headers
            assert len(fake_state(pre)["requests"]) == 2
            assert fake_state(dec)["requests"][2] == short

            # A client that drives P/D itself, and n > 1: passed through, never split.
            own = {**short, "prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}}
            r = post(url, own)
            assert r.headers["x-kvserve-pd-reason"] == "client_kv_transfer_params"
            assert fake_state(dec)["requests"][3] == own
            r = post(url, {**short, "prompt": PROMPT, "n": 2})
            assert r.headers["x-kvserve-pd-reason"] == "n_gt_1"
            assert len(fake_state(pre)["requests"]) == 2

            assert pd_count(url, "true", "uncached_above_threshold") == 2
            assert pd_count(url, "false", "below_threshold") == 1
            assert pd_count(url, "false", "client_kv_transfer_params") == 1
            hist = metrics(url, "kvserve_router_pd_prefill_seconds_count")
            assert hist == {(("endpoint", "prefill0"),): 2.0}
            assert fallbacks(url) == {}
            gauge = metrics(url, "kvserve_router_endpoint_prefill_in_flight")
            assert gauge[(("endpoint", "prefill0"),)] == 0


def _stored(tokens: list[int], first_hash: int) -> BlockStored:
    n = len(tokens) // 16
    return BlockStored(
        block_hashes=list(range(first_hash, first_hash + n)),
        parent_block_hash=None,
        token_ids=tokens[: n * 16],
        block_size=16,
        medium="GPU",
    )


def test_prefix_held_on_the_decode_side_is_not_prefilled_elsewhere(tmp_path: Path) -> None:
    """Decode endpoint first (where the prefix is, by KV events), then only the tokens it
    lacks count against the threshold."""
    pub = [ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") for _ in range(2)]
    try:
        with backend() as (pre, _), backend() as (d0, _), backend() as (d1, _):
            cfg = pd_router_config([pre], [d0, d1])
            for e, p in zip(cfg["endpoints"][1:], pub, strict=True):
                e.update(kv_events=p.endpoint, kv_events_replay=p.replay_endpoint)
            cfg["scheduler"] = {
                "scorers": [
                    {"name": "precise_prefix", "weight": 3, "params": {"speculative_ttl_s": 120}},
                    {"name": "load", "weight": 1},
                ]
            }
            with router_process(tmp_path, cfg) as url:
                wait_all_healthy(url, 3)
                # decode1 holds 5 of the prompt's 6 full blocks (80 of 100 tokens).
                pub[1].publish([_stored(PROMPT[:80], 1)])

                def indexed() -> bool:
                    st = httpx.get(url + "/router/state", trust_env=False).json()
                    return {e["name"]: e["kv_blocks"] for e in st["endpoints"]}["decode1"] == 5

                until(indexed, 20, "decode1's blocks indexed")
                r = post(url, {"model": "m", "prompt": PROMPT, "max_tokens": 2})
                assert r.headers["x-kvserve-decode-endpoint"] == "decode1"
                assert r.headers["x-kvserve-disaggregated"] == "false"
                assert r.headers["x-kvserve-pd-reason"] == "below_threshold"  # 20 uncached
                # Another prompt sharing 2 blocks with it: 68 uncached on decode1: split.
                other = PROMPT[:32] + list(range(5000, 5068))
                r = post(url, {"model": "m", "prompt": other, "max_tokens": 2})
                assert r.headers["x-kvserve-decode-endpoint"] == "decode1"
                assert r.headers["x-kvserve-disaggregated"] == "true"
                # The same prompt again: its decode endpoint holds it now (it pulled the KV;
                # until its events say so, the router's speculative entry does): not split.
                r = post(url, {"model": "m", "prompt": other, "max_tokens": 2})
                assert r.headers["x-kvserve-decode-endpoint"] == "decode1"
                assert r.headers["x-kvserve-pd-reason"] == "below_threshold"
                assert len(fake_state(pre)["requests"]) == 1
                assert len(fake_state(d0)["requests"]) == 0
    finally:
        for p in pub:
            p.close()


def test_saturated_or_absent_prefill_pool_means_no_split(tmp_path: Path) -> None:
    with backend() as (pre, _), backend() as (dec, _):
        cfg = pd_router_config([pre], [dec], prefill_max_active=1)
        with router_process(tmp_path, cfg) as url:
            wait_all_healthy(url, 2)
            fake_config(pre, prefill_delay=3.0)
            first: dict[str, Any] = {}
            t = threading.Thread(
                target=lambda: first.update(r=post(url, {"model": "m", "prompt": PROMPT}))
            )
            t.start()
            until(lambda: fake_state(pre)["prefill_legs"] == 1, 20, "prefill leg in flight")
            gauge = metrics(url, "kvserve_router_endpoint_prefill_in_flight")
            assert gauge[(("endpoint", "prefill0"),)] == 1
            # The decode endpoint counts the request already (its load, for the scorers).
            gauge = metrics(url, "kvserve_router_endpoint_in_flight")
            assert gauge[(("endpoint", "decode0"),)] == 1
            t0 = time.monotonic()
            r = post(url, {"model": "m", "prompt": list(range(3000, 3100))})
            assert r.status_code == 200 and time.monotonic() - t0 < 2.5  # not queued behind
            assert r.headers["x-kvserve-disaggregated"] == "false"
            assert r.headers["x-kvserve-pd-reason"] == "prefill_saturated"
            t.join(60)
            assert first["r"].status_code == 200
            assert first["r"].headers["x-kvserve-disaggregated"] == "true"
            assert pd_count(url, "false", "prefill_saturated") == 1
            # The prefill endpoint fails its health checks: out of the pool.
            fake_config(pre, healthy=False, prefill_delay=0)
            wait_all_healthy(url, 1)
            # (A new prompt: the decode endpoint holds those it served, says the history.)
            r = post(url, {"model": "m", "prompt": list(range(4000, 4100))})
            assert r.status_code == 200 and r.headers["x-kvserve-disaggregated"] == "false"
            assert r.headers["x-kvserve-pd-reason"] == "no_prefill_endpoint"


def test_prefill_killed_erroring_slow_or_silent_decode_serves_alone(tmp_path: Path) -> None:
    with backend() as (pre, kill_pre), backend() as (dec, _):
        # Health checks far apart: the router learns of trouble from the legs themselves.
        cfg = pd_router_config([pre], [dec], health_s=120.0, prefill_timeout_s=1.0)
        with router_process(tmp_path, cfg) as url:
            wait_all_healthy(url, 2)
            # A new prompt each time (the decode endpoint holds those it served).
            prompts = (list(range(k * 1000, k * 1000 + 100)) for k in range(10, 20))
            cases = [
                ({"fail_status": 500}, "http_500"),
                ({"fail_status": 0, "pd_no_params": True}, "no_kv_transfer_params"),
                ({"pd_no_params": False, "prefill_delay": 30.0}, "timeout"),
            ]
            for i, (setting, error) in enumerate(cases):
                fake_config(pre, **setting)
                body = {"model": "m", "prompt": next(prompts), "max_tokens": 4}
                t0 = time.monotonic()
                r = post(url, body)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvserve-disaggregated"] == "false"
                assert r.headers["x-kvserve-pd-reason"] == f"prefill_failed:{error}"
                assert r.headers["x-kvserve-prefill-endpoint"] == "prefill0"
                assert r.json()["choices"][0]["text"] == "from b0"  # prefilled itself
                assert fake_state(dec)["requests"][i] == body  # no kv_transfer_params
                assert fallbacks(url)[error] == 1
                if error == "timeout":
                    assert time.monotonic() - t0 < 10
                    # The abandoned leg's connection was closed: the engine aborts it.
                    until(lambda: fake_state(pre)["disconnects"] == 1, 10, "prefill aborted")
            fake_config(pre, prefill_delay=0)
            kill_pre()
            body = {"model": "m", "prompt": next(prompts), "max_tokens": 4}
            r = post(url, body)
            assert r.status_code == 200
            assert r.headers["x-kvserve-pd-reason"] == "prefill_failed:connect"
            assert fake_state(dec)["requests"][-1] == body
            # Refused: out of the rotation at once, so the next ones are not even tried.
            r = post(url, {"model": "m", "prompt": next(prompts)})
            assert r.headers["x-kvserve-pd-reason"] == "no_prefill_endpoint"
            assert fallbacks(url)["connect"] == 1


def test_decode_down_before_the_first_byte_retries_with_the_same_params(tmp_path: Path) -> None:
    with backend() as (pre, _), backend() as (d0, kill_d0), backend() as (d1, _):
        cfg = pd_router_config([pre], [d0, d1], health_s=120.0)
        cfg["scheduler"] = {"scorers": [], "picker": {"name": "round_robin"}}
        with router_process(tmp_path, cfg) as url:
            wait_all_healthy(url, 3)
            kill_d0()
            for i in range(2):
                r = post(url, {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": i == 1})
                assert r.status_code == 200, r.text
                assert r.headers["x-kvserve-disaggregated"] == "true"
                assert r.headers["x-kvserve-decode-endpoint"] == "decode1"
                assert "pulled from engine-b0" in r.text
            # Each decode leg carried its own prefill's parameters, one prefill leg each.
            got = [b["kv_transfer_params"] for b in fake_state(d1)["requests"]]
            assert got == [producer_params(pre, 1), producer_params(pre, 2)]
            assert fake_state(pre)["prefill_legs"] == 2
            failovers = metrics(url, "kvserve_router_failovers_total")
            assert failovers == {(("endpoint", "decode0"), ("error", "connect")): 1.0}


def test_client_gone_cancels_the_leg_in_flight(tmp_path: Path) -> None:
    with backend() as (pre, _), backend() as (dec, _):
        cfg = pd_router_config([pre], [dec])
        with router_process(tmp_path, cfg) as url:
            wait_all_healthy(url, 2)
            # During the prefill leg.
            fake_config(pre, prefill_delay=30.0)
            with contextlib.suppress(httpx.TimeoutException):
                post(url, {"model": "m", "prompt": PROMPT}, timeout=1.0)
            until(lambda: fake_state(pre)["disconnects"] == 1, 15, "prefill leg cancelled")
            until(
                lambda: (
                    metrics(url, "kvserve_router_endpoint_prefill_in_flight")
                    == {(("endpoint", "prefill0"),): 0.0, (("endpoint", "decode0"),): 0.0}
                ),
                10,
                "prefill leg accounted",
            )
            assert fake_state(dec)["requests"] == []  # no decode leg ever started
            # During the decode leg (a stream the client leaves after its first event).
            fake_config(pre, prefill_delay=0)
            fake_config(dec, chunks=20, chunk_interval=0.5)
            body = {"model": "m", "prompt": PROMPT, "stream": True}
            with httpx.stream(
                "POST", url + "/v1/completions", json=body, timeout=30, trust_env=False
            ) as r:
                assert r.headers["x-kvserve-disaggregated"] == "true"
                next(r.iter_raw())
            until(lambda: fake_state(dec)["disconnects"] == 1, 15, "decode leg cancelled")
            assert fake_state(dec)["completed"] == 0


def test_p_d_off_and_prefill_only_endpoints(tmp_path: Path) -> None:
    with backend() as (pre, _), backend() as (dec, _):
        cfg = pd_router_config([pre], [dec], threshold=0)
        with router_process(tmp_path, cfg) as url:
            wait_all_healthy(url, 2)
            for _ in range(4):
                r = post(url, {"model": "m", "prompt": PROMPT})
                assert r.status_code == 200 and r.headers["x-kvserve-endpoint"] == "decode0"
                assert "x-kvserve-disaggregated" not in r.headers
            assert fake_state(pre)["requests"] == []
        cfg = pd_router_config([pre], [])
        with router_process(tmp_path, cfg) as url:
            wait_all_healthy(url, 1)
            r = post(url, {"model": "m", "prompt": PROMPT})
            assert r.status_code == 503 and "no decode endpoint" in r.json()["error"]["message"]
