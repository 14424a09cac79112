"""Real processes for router tests: `kvserve route` and the fake OpenAI backends, each in its
own process on free loopback ports, and a raw HTTP/1.1 client that can hold thousands of
connections (one request each) without a client library's pools in the way."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvserve.bench.loadgen import wait_for_server
from kvserve.bench.local_cluster import free_port

REPO = Path(__file__).resolve().parents[2]


def _stop(popen: subprocess.Popen) -> None:
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


@contextlib.contextmanager
def fake_backends(count: int = 1, *args: str) -> Iterator[list[str]]:
    """``count`` fake backends in one process (``args``: its flags); yields their URLs."""
    popen = subprocess.Popen(
        [sys.executable, "-m", "tests.cluster.fake_openai_backend", "--count", str(count), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert popen.stdout is not None
        line = popen.stdout.readline()
        if not line:
            raise RuntimeError(f"fake backends exited with {popen.wait()}")
        yield [f"http://127.0.0.1:{p}" for p in json.loads(line)["ports"]]
    finally:
        _stop(popen)


@contextlib.contextmanager
def router_process(
    tmp_path: Path,
    config: dict[str, Any],
    *args: str,
    env: dict[str, str] | None = None,
    ready: bool = True,
) -> Iterator[str]:
    """`kvserve route --config` with ``config`` (YAML) and ``args``; yields its base URL once
    /health answers 200 (``ready``: else as soon as it listens)."""
    port = free_port()
    path = tmp_path / f"router-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp_path / f"router-{port}.log", "wb")  # noqa: SIM115 - closed below
    popen = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "route", "--config", str(path)]
        + ["--port", str(port), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        if ready:
            wait_for_server(url, timeout=60, proc=popen)
        else:
            _wait_listening(port, popen)
        yield url
    finally:
        _stop(popen)
        log.close()


def _wait_listening(port: int, popen: subprocess.Popen, timeout: float = 60.0) -> None:
    import socket
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if popen.poll() is not None:
            raise RuntimeError(f"router exited with {popen.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.1)
    raise TimeoutError("router not listening")


# ------------------------------------------------------------------------------ raw client


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names (last value wins)
    body: bytes
    elapsed: float

    def json(self) -> Any:
        return json.loads(self.body)


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


async def raw_request(
    url: str,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> RawResponse:
    """One request on its own connection (``connection: close``), read to EOF."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", _port_of(url)), timeout
    )
    try:
        head = f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
        for k, v in (headers or {}).items():
            head += f"{k}: {v}\r\n"
        if body or method == "POST":
            head += f"content-length: {len(body)}\r\n"
        writer.write(head.encode("latin-1") + b"\r\n" + body)
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    return parse_response(data, loop.time() - t0)


def parse_response(data: bytes, elapsed: float = 0.0) -> RawResponse:
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/1.1 "):
        raise ValueError(f"not an HTTP/1.1 response: {data[:80]!r}")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2 :]
        rest = body
    return RawResponse(status, headers, rest, elapsed)


def is_openai_error(resp: RawResponse) -> bool:
    """An OpenAI-shaped error body: message, type, param, code (a string or null)."""
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        isinstance(err, dict)
        and isinstance(err.get("message"), str)
        and isinstance(err.get("type"), str)
        and "param" in err
        and (err.get("code") is None or isinstance(err.get("code"), str))
    )


# ------------------------------------------------------------------------------ fake control


def fake_config(url: str, **values: Any) -> None:
    """Set attributes of a fake backend in another process (``POST /_fake/config``)."""
    import httpx

    r = httpx.post(url + "/_fake/config", json=values, timeout=10, trust_env=False)
    r.raise_for_status()


def fake_state(url: str) -> dict[str, Any]:
    """What a fake backend in another process received (``GET /_fake/state``)."""
    import httpx

    r = httpx.get(url + "/_fake/state", timeout=10, trust_env=False)
    r.raise_for_status()
    return r.json()


def metric_samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of metric ``name`` in Prometheus text, by sorted label pairs."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out
