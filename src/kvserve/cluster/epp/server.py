"""`kvserve route --epp`: the router as a Gateway API Inference Extension Endpoint Picker.

Owns the gRPC side: ``envoy.service.ext_proc.v3.ExternalProcessor`` (one
:class:`~kvserve.cluster.epp.processor.ExtProcStream` per HTTP request through the gateway)
and the gRPC Health Checking service, in the router's own event loop, so the ext_proc streams
share the scheduling core (the :class:`~kvserve.cluster.gateway.Router`: endpoint pool, KV
index and its event subscribers, history, scheduler, metrics) with the HTTP front end, which
keeps serving ``/metrics``, ``/health`` and ``/router/state`` (and the OpenAI API) on the
router's HTTP port.

Transport (``epp_transport``): ``loop`` (the default), kvserve's own HTTP/2 gRPC server on
the loop's sockets (:mod:`~kvserve.cluster.epp.grpc_server`); ``grpcio``, ``grpc.aio``
(about 0.7 ms more CPU per request: its completion queue and poller thread).

Health: ``liveness`` is SERVING while the process runs; ``readiness``, the overall service
``""`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` are NOT_SERVING until the core
has checked every endpoint once (its view of the endpoints is synced), then SERVING, and
NOT_SERVING again while the process stops.

Endpoints are ``ip:port`` (the host and port of each endpoint URL: one per data-parallel
rank / target port); the gateway connects to them directly, so their hosts should be IP
addresses.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Gauge

from kvserve.cluster.endpoints import Endpoint
from kvserve.cluster.epp.grpc_server import Call, GrpcServer, Method
from kvserve.cluster.epp.health import HealthService
from kvserve.cluster.epp.idle_gc import IdleCollector
from kvserve.cluster.epp.processor import ExtProcStream, Observers
from kvserve.cluster.gateway import Router, wait_for_stop_signal
from kvserve.cluster.headers import OBSERVED_METADATA, REQUEST_HEADERS_READ

logger = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
TRANSPORTS = ("loop", "grpcio")
LIVENESS, READINESS = "liveness", "readiness"
DEFAULT_EPP_PORT = 9002
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_OBSERVED_KEY = OBSERVED_METADATA.encode()


def open_stream(epp: EndpointPicker, call: Call) -> ExtProcStream:
    """One ext_proc stream on the in-loop server: its messages are handed to the returned
    handler as they arrive; its end (the request's, or Envoy or its connection going away)
    releases what the stream holds."""
    epp.streams += 1
    return ExtProcStream(epp, call, _OBSERVED_KEY in call.metadata)


class _Processor(pb_grpc.ExternalProcessorServicer):
    """The same on ``grpc.aio`` (``epp_transport: grpcio``)."""

    def __init__(self, epp: EndpointPicker) -> None:
        self.epp = epp

    async def Process(  # noqa: N802 - the gRPC method's name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context
    ) -> None:
        # context.read()/write() rather than iterating and yielding: measured ~0.3 ms less
        # CPU per request (grpc.aio's async-generator path costs more per message).
        observed = any(k == OBSERVED_METADATA for k, _ in context.invocation_metadata() or ())
        stream = ExtProcStream(self.epp, observed=observed)
        self.epp.streams += 1
        try:
            while (msg := await context.read()) is not grpc.aio.EOF:
                answers = stream.handle(msg)
                if type(answers) is not list:
                    answers = await answers
                for out in answers:
                    if type(out) is bytes:  # (serialized once for the in-loop transport)
                        out = pb.ProcessingResponse.FromString(out)
                    await context.write(out)
        finally:
            stream.on_end()


def endpoint_address(ep: Endpoint) -> str:
    """``ip:port`` of an endpoint as the gateway connects to it."""
    host = ep.origin.host
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{ep.origin.port}"


class EndpointPicker:
    """The ext_proc and health gRPC services around a :class:`Router` (the scheduling core)."""

    def __init__(
        self,
        core: Router,
        host: str | None = None,
        port: int | None = None,
        transport: str | None = None,
    ) -> None:
        self.core = core
        cfg = core.config
        self.host = cfg.host if host is None else host
        self.port = (cfg.epp_port or DEFAULT_EPP_PORT) if port is None else port
        self.transport = transport or cfg.epp_transport
        if self.transport not in TRANSPORTS:
            raise ValueError(f"epp_transport must be one of {TRANSPORTS}")
        self.max_body_bytes = cfg.max_body_bytes
        # Shed (429) past the router's own per-endpoint limits: connections + queue.
        self.max_in_flight = cfg.max_connections_per_endpoint + cfg.max_queue_per_endpoint
        self.session_header = cfg.session_header.lower()
        # The request headers a stream keeps (the rest are not read: not decoded either)
        self.request_headers = frozenset((*REQUEST_HEADERS_READ, self.session_header))
        self.streams = 0  # ext_proc streams open
        self.observers = Observers()  # observed picks awaiting their response's report
        self.health = HealthService()  # the statuses (served by either transport)
        self._aio_health: health.aio.HealthServicer | None = None
        self._server: GrpcServer | grpc.aio.Server | None = None
        self._addresses: dict[str, Endpoint] = {}
        self._address_of: dict[int, str] = {}  # id(endpoint) -> its address (while in the pool)
        core.pool.on_added.append(self._added)
        core.pool.on_removed.append(self._removed)
        Gauge(
            "kvserve_router_epp_streams",
            "Envoy ext_proc streams open (HTTP requests the EPP is following)",
            registry=core.metrics.registry,
        ).set_function(lambda: self.streams)

    def _added(self, ep: Endpoint) -> None:
        address = endpoint_address(ep)
        self._addresses[address] = ep
        self._address_of[id(ep)] = address

    def _removed(self, ep: Endpoint) -> None:
        address = self._address_of.pop(id(ep), None) or endpoint_address(ep)
        if self._addresses.get(address) is ep:
            del self._addresses[address]

    def after_reads(self, fn: Callable[[], object]) -> bool:
        """``fn()`` at the end of each read of the gateway's connections that leaves no
        call open, once its answers are written (the loop transport); False where the
        transport has no such hook."""
        if not isinstance(self._server, GrpcServer):
            return False
        self._server.after_read = fn
        return True

    def address_of(self, ep: Endpoint) -> str:
        address = self._address_of.get(id(ep))
        return address if address is not None else endpoint_address(ep)

    def endpoint_at(self, address: str) -> Endpoint | None:
        return self._addresses.get(address)

    async def _set(self, service: str, status: int) -> None:
        self.health.set(service, status)
        if self._aio_health is not None:
            await self._aio_health.set(service, status)

    async def _set_ready(self, ready: bool) -> None:
        status = _SERVING if ready else _NOT_SERVING
        for service in ("", READINESS, EXT_PROC_SERVICE):
            await self._set(service, status)

    async def _listen(self) -> int:
        if self.transport == "loop":
            methods = {
                f"/{EXT_PROC_SERVICE}/Process": Method(
                    pb.ProcessingRequest, stream=lambda call: open_stream(self, call)
                ),
                **self.health.methods(),
            }
            server = GrpcServer(methods, max_message_bytes=2 * self.max_body_bytes)
            self._server = server
            return await server.start(self.host, self.port)
        aio = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", 2 * self.max_body_bytes),
                ("grpc.max_send_message_length", 2 * self.max_body_bytes),
            ]
        )
        self._server = aio
        self._aio_health = health.aio.HealthServicer()
        pb_grpc.add_ExternalProcessorServicer_to_server(_Processor(self), aio)
        health_pb2_grpc.add_HealthServicer_to_server(self._aio_health, aio)
        bound = aio.add_insecure_port(f"{self.host}:{self.port}")
        if bound == 0:
            raise OSError(f"cannot listen on {self.host}:{self.port} (gRPC)")
        await aio.start()
        return bound

    async def start(self) -> int:
        """Listen (not ready), start the core (router and its HTTP port), then be ready.
        Returns the bound gRPC port (``port=0``: a free one)."""
        await self._set(LIVENESS, _SERVING)
        await self._set_ready(False)
        self.port = await self._listen()
        await self.core.start()  # returns once every endpoint was checked once
        await self._set_ready(True)
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        await self._set_ready(False)
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        await self.core.stop()


async def serve_forever(core: Router) -> None:
    epp = EndpointPicker(core)
    await epp.start()
    gc.collect()
    gc.freeze()
    collector = IdleCollector()  # young collections between callbacks, not in a request's
    collector.start()
    epp.after_reads(collector.after_read)  # (and after the EPP's reads: fewer timer wake-ups)
    logger.warning(
        "kvserve route --epp: ext_proc on %s:%s, HTTP on %s:%s",
        epp.host,
        epp.port,
        core.config.host,
        core.port,
    )
    try:
        await wait_for_stop_signal()
    finally:
        collector.stop()
        await epp.stop()
