"""A local kvserve cluster in subprocesses: N engine servers (``kvserve serve``) with KV events,
and a router (``kvserve route``) in front. Used by the demo, ``kvserve up`` and the routing
benchmarks. Every process is stopped on exit, on error and on Ctrl-C.

API keys: with ``api_key`` the router requires it from clients, and the engines require a
key of their own (random, :attr:`LocalCluster.engine_api_key`) that the router sends them;
keys travel in the processes' environment, not their command lines. Without it, API key
variables in this process's environment are kept from the children, so a cluster (the demo)
is open whatever the shell exports.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.bench.loadgen import LoadConfig, http_run, wait_for_server
from kvserve.bench.ports import free_port, free_port_block


def offset_url(url: str, rank: int) -> str:
    from kvserve.cluster.data_parallel import offset_url as offset

    return offset(url, rank)


@dataclass
class ClusterSpec:
    model_dir: str
    num_engines: int = 2
    engine_args: list[str] = field(default_factory=list)  # extra `kvserve serve` flags
    offload_gib: float = 0.0  # host-memory KV tier per engine (0: off)
    kv_tiers: list[str] = field(default_factory=list)  # storage tiers below it (--kv-tier)
    router_args: list[str] = field(default_factory=list)  # e.g. ["--picker", "round_robin"]
    served_model_name: str = "tiny"
    log_dir: str | None = None  # engine/router logs (default: a temporary directory)
    api_key: str | None = None  # the router's clients must send it (None: no authentication)
    # Ranks per engine (`kvserve serve --data-parallel-size`): each rank its own router endpoint.
    data_parallel_size: int = 1


# Variables the engines and the router read their API keys from (never inherited).
_KEY_ENV = ("KVSERVE_API_KEY", "VLLM_API_KEY", "KVSERVE_UPSTREAM_API_KEY")


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    url: str


class LocalCluster:
    """``with LocalCluster(spec) as c: c.router_url`` — everything up, then torn down."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.engines: list[_Proc] = []
        self.router: _Proc | None = None
        # The engines' own key (only the router needs it), when the cluster has keys at all.
        self.engine_api_key: str | None = secrets.token_urlsafe(24) if spec.api_key else None
        self._logs: list = []
        log_dir = spec.log_dir or os.path.join(
            os.environ.get("TMPDIR", "/tmp"), f"kvserve-cluster-{os.getpid()}"
        )
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    @property
    def router_url(self) -> str:
        assert self.router is not None
        return self.router.url

    @property
    def engine_urls(self) -> list[str]:
        """Every engine's URL (every rank's, for data-parallel engines)."""
        n = self.spec.data_parallel_size
        if n == 1:
            return [p.url for p in self.engines]
        return [offset_url(p.url, r) for p in self.engines for r in range(n)]

    def run_workload(self, workload, *, concurrency: int, label: str, seed: int, **kw):
        """Drive ``workload`` through the router, closed loop; returns the ``report.Run``.

        ``kw``: ``tokenize`` for :func:`http_run`, the rest for :class:`LoadConfig`.
        """
        tokenize = kw.pop("tokenize", None)
        cfg = LoadConfig(
            base_url=self.router_url,
            model=self.spec.served_model_name,
            concurrency=concurrency,
            label=label,
            seed=seed,
            **kw,
        )
        return http_run(workload, cfg, tokenize=tokenize)[1]

    def _spawn(
        self, name: str, argv: list[str], url: str, keys: dict[str, str] | None = None
    ) -> _Proc:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        env = {k: v for k, v in os.environ.items() if k not in _KEY_ENV}
        popen = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # our Ctrl-C handling stops it, not the terminal's
            env={**env, **(keys or {})},
        )
        return _Proc(name, popen, url)

    def start(self, timeout: float = 180.0) -> LocalCluster:
        spec = self.spec
        endpoints = []
        try:
            n = spec.data_parallel_size
            for i in range(spec.num_engines):
                if n == 1:
                    port, ev_port, replay_port = free_port(), free_port(), free_port()
                else:  # rank r listens and publishes on port + r
                    port, ev_port, replay_port = (free_port_block("127.0.0.1", n) for _ in "abc")
                argv = [
                    "serve",
                    "--model", spec.model_dir,
                    "--served-model-name", spec.served_model_name,
                    "--port", str(port),
                    "--kv-events-endpoint", f"tcp://127.0.0.1:{ev_port}",
                    "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
                    *(["--kv-offload-size", str(spec.offload_gib)] if spec.offload_gib else []),
                    *[a for t in spec.kv_tiers for a in ("--kv-tier", t)],
                    *(["--data-parallel-size", str(n)] if n > 1 else []),
                    *spec.engine_args,
                ]  # fmt: skip
                url = f"http://127.0.0.1:{port}"
                keys = {"KVSERVE_API_KEY": self.engine_api_key} if self.engine_api_key else None
                self.engines.append(self._spawn(f"engine{i}", argv, url, keys))
                endpoints.append(
                    f"{url},events=tcp://127.0.0.1:{ev_port},"
                    f"replay=tcp://127.0.0.1:{replay_port},name=engine{i}"
                    + (f",dp={n}" if n > 1 else "")
                )
            rport = free_port()
            argv = ["route", "--port", str(rport), "--tokenizer", spec.model_dir]
            for ep in endpoints:
                argv += ["--endpoint", ep]
            argv += spec.router_args
            keys = None
            if spec.api_key and self.engine_api_key:
                keys = {
                    "KVSERVE_API_KEY": spec.api_key,
                    "KVSERVE_UPSTREAM_API_KEY": self.engine_api_key,
                }
            self.router = self._spawn("router", argv, f"http://127.0.0.1:{rport}", keys)
            for p in [*self.engines, self.router]:
                wait_for_server(p.url, timeout=timeout, proc=p.popen)
            for url in self.engine_urls:  # every rank of data-parallel engines
                wait_for_server(url, timeout=timeout)
            self._wait_router_sees_engines(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_router_sees_engines(self, timeout: float) -> None:
        """Every engine healthy in the router (after its first health checks)."""
        import httpx

        end = time.monotonic() + timeout
        auth = {"Authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}
        while time.monotonic() < end:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                r = httpx.get(
                    self.router_url + "/router/state", headers=auth, timeout=5.0, trust_env=False
                )
                eps = r.json()["endpoints"]
                want = len(self.engines) * self.spec.data_parallel_size
                if len(eps) == want and all(e["healthy"] for e in eps):
                    return
            time.sleep(0.2)
        raise TimeoutError("router did not see every engine healthy")

    def stop(self) -> None:
        procs = [p for p in [self.router, *self.engines] if p is not None]
        for p in procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()
        self.engines, self.router = [], None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
