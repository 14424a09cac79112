"""gRPC Health Checking (``grpc.health.v1.Health``) on the EPP's in-loop gRPC server.

Owns the serving status of each service name and its two methods: ``Check`` (unary; an
unknown service is NOT_FOUND) and ``Watch`` (the status now, then each change, until the
client goes away; an unknown service is SERVICE_UNKNOWN until it is set).
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from kvserve.cluster.epp.grpc_server import NOT_FOUND, Call, GrpcError, Method

SERVICE = "grpc.health.v1.Health"
_Response = health_pb2.HealthCheckResponse


class HealthService:
    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self._changed = asyncio.Event()  # set and replaced on every change

    def set(self, service: str, status: int) -> None:
        if self.statuses.get(service) == status:
            return
        self.statuses[service] = status
        self._changed.set()
        self._changed = asyncio.Event()

    def methods(self) -> dict[str, Method]:
        req = health_pb2.HealthCheckRequest
        return {
            f"/{SERVICE}/Check": Method(req, self._check),
            f"/{SERVICE}/Watch": Method(req, self._watch),
        }

    async def _check(self, call: Call) -> None:
        req = await call.read()
        service = "" if req is None else req.service
        status = self.statuses.get(service)
        if status is None:
            raise GrpcError(NOT_FOUND, f"unknown service {service!r}")
        call.write(_Response(status=status))

    async def _watch(self, call: Call) -> None:
        req = await call.read()
        service = "" if req is None else req.service
        waiter = asyncio.ensure_future(_until_gone(call))
        try:
            sent = None
            while not waiter.done():
                status = self.statuses.get(service, _Response.SERVICE_UNKNOWN)
                if status != sent:
                    call.write(_Response(status=status))
                    sent = status
                changed = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait({changed, waiter}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
        finally:
            waiter.cancel()


async def _until_gone(call: Call) -> None:
    while await call.read() is not None:  # (a client says nothing more after its request)
        pass
    await call.wait_closed()
