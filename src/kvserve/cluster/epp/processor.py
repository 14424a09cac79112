"""One ext_proc stream: Envoy's view of one HTTP request, answered with an endpoint pick.

Owns the message sequence of ``envoy.service.ext_proc.v3.ExternalProcessor/Process`` for
the body modes Envoy announces in ``protocol_config``:

- ``FULL_DUPLEX_STREAMED`` (the Inference Extension's mode): headers and body chunks arrive
  without waiting; at the end of the body the pick goes out as the headers response, then
  the body is echoed back (``streamed_response``, pieces of at most ``ECHO_CHUNK`` bytes:
  what the processor does not send back, the upstream does not get);
- ``BUFFERED`` (and ``BUFFERED_PARTIAL``): headers are continued as they are, the whole body
  arrives in one message and the pick rides on the body response (headers are held until
  then);
- ``STREAMED`` with ``send_body_without_waiting_for_header_response``: chunks arrive while
  the headers wait; the pick goes out with the headers response, then each chunk is
  continued. Without that option (or a request without a body) the pick is made on the
  headers alone.

The pick is the ordered fallback list ``ip:port,...`` in the request header
``x-gateway-destination-endpoint`` and in the dynamic metadata ``envoy.lb`` (the same value);
its first address alone in ``x-kvserve-destination-endpoint`` (for a gateway that takes one).
When the first endpoint has its own API key, the request carries that key instead of the
client's (checked first against the router's keys, as the HTTP router does). Errors are
immediate responses with an OpenAI-style body: 400 (bad JSON), 401 (no valid key), 404
(unknown model), 413 (body over the limit), 429 (every candidate at its limit: shed), 503
(no ready endpoint, or none in the gateway's subset hint).

The response path teaches the scheduling core where the request was served: the metadata
``envoy.lb`` / ``x-gateway-destination-endpoint-served`` when the gateway reports it, else a
response header of that name (a gateway adding the upstream's address to the response, as
plain Envoy can with ``%UPSTREAM_REMOTE_ADDRESS%``: the EPP removes it before the client
sees it), else the ``upstream.address`` attribute. The picked endpoint's in-flight count
moves there, and is released at the end of the response: for an answer with a length, at its
headers (the engine has finished); for an event stream, when the ext_proc stream ends (Envoy
ends it with the HTTP request: after the stream's last event, or when the client goes away),
or at its last chunk where the body still comes through (FULL_DUPLEX_STREAMED); whichever is
first. Envoy is asked to skip the response body (``mode_override``): the events of a stream
are not held for an answer of the EPP each.

Observed responses (a gateway that must not wait for the EPP on the response path): the
picking stream sees only the request (its gRPC metadata ``x-kvserve-observed``) and holds the
pick's in-flight count until Envoy ends it with the HTTP request; its pick also carries the
dynamic metadata ``kvserve`` = {``id``: a key of this EPP's, ``endpoint``: the first
endpoint's name} (Envoy's route can name the endpoint to the client from it). A second ext_proc
filter in Envoy's ``observability_mode`` (it sends, never waits, ignores answers) reports the
response headers with that metadata on a stream of their own: the EPP finds the pick by the
id (:class:`Observers`: picks whose report has not come, each kept a while after its
request ended, since the report may arrive after the picking stream's end) and learns from it
what it learns from response headers otherwise (the served endpoint, status and first-byte
metrics, the probe after Envoy's own 502-504). It answers nothing on that stream. Both
streams of a request must reach the same EPP (one address: the Service's, not a pod list).

Cost per request (the transport hands each message over in the loop turn it arrives in):
:meth:`ExtProcStream.handle` answers synchronously unless the pick must wait (a long prompt
tokenized off the loop), and the answers that recur are serialized once (``bytes``): the
continue messages, each fallback list's pick (header mutation and ``envoy.lb`` metadata,
as a headers or a body response) and each served endpoint's response-headers answer.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvserve.cluster.filters import NoEndpointError
from kvserve.cluster.headers import (
    DESTINATION_HEADER,
    ENDPOINT_HEADER,
    FIRST_DESTINATION_HEADER,
    LB_NAMESPACE,
    OBSERVER_NAMESPACE,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from kvserve.cluster.routing_request import RoutingRequest
from kvserve.cluster.tokenization import BadRequestError

if TYPE_CHECKING:
    from kvserve.cluster.endpoints import Endpoint
    from kvserve.cluster.epp.grpc_server import Call
    from kvserve.cluster.epp.server import EndpointPicker
    from kvserve.cluster.gateway import Router
    from kvserve.cluster.metrics import RouterMetrics
    from kvserve.cluster.scheduler import Decision

logger = logging.getLogger(__name__)

ECHO_CHUNK = 60 << 10  # body echoed back in pieces of at most this (Envoy's own are ~62 KB)
_EXT_PROC_ATTRS = "envoy.filters.http.ext_proc"

_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
STREAMED = _Mode.STREAMED
BUFFERED = _Mode.BUFFERED
BUFFERED_PARTIAL = _Mode.BUFFERED_PARTIAL
NONE = _Mode.NONE
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_CONTINUE = pb.CommonResponse()
_SKIP_RESPONSE_BODY = _Mode(response_body_mode=NONE, response_trailer_mode=_Mode.SKIP)
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
_COMPLETION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}
# Constant answers, serialized once (``bytes``: an answer already on the wire's form).
Answer = pb.ProcessingResponse | bytes
_REQUEST_HEADERS_CONTINUE = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(response=_CONTINUE)
).SerializeToString()
_REQUEST_BODY_CONTINUE = pb.ProcessingResponse(
    request_body=pb.BodyResponse(response=_CONTINUE)
).SerializeToString()
_RESPONSE_BODY_CONTINUE = pb.ProcessingResponse(
    response_body=pb.BodyResponse(response=_CONTINUE)
).SerializeToString()
_REQUEST_TRAILERS_CONTINUE = pb.ProcessingResponse(
    request_trailers=pb.TrailersResponse()
).SerializeToString()
_RESPONSE_TRAILERS_CONTINUE = pb.ProcessingResponse(
    response_trailers=pb.TrailersResponse()
).SerializeToString()
_PICK_CACHE_SIZE = 4096  # distinct fallback lists kept built (few: orders of a few endpoints)
T = TypeVar("T")
R = TypeVar("R")


def _header_value(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode("latin-1")),
        append_action=_OVERWRITE,
    )


def immediate(
    status: int,
    message: str,
    etype: str,
    code: str | None = None,
    retry_after: int | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> pb.ProcessingResponse:
    """An ImmediateResponse with an OpenAI-style error body."""
    body = {"error": {"message": message, "type": etype, "param": None, "code": code}}
    out = [_header_value("content-type", "application/json")]
    out += [_header_value(k, v) for k, v in headers]
    if retry_after is not None:
        out.append(_header_value("retry-after", str(retry_after)))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=out),
            body=_json_encode(body),
            details=f"kvserve_epp_{status}",
        )
    )


class Pick:
    """The answer: the ordered fallback list as a header mutation and ``envoy.lb`` metadata,
    and the headers and body responses that carry both, serialized (built once per distinct
    list: see :meth:`of`)."""

    __slots__ = ("value", "mutation", "metadata", "headers_response", "body_response")

    def __init__(self, addresses: list[str], auth: tuple[bytes, bytes] | None = None) -> None:
        self.value = ",".join(addresses)
        headers = [
            _header_value(DESTINATION_HEADER, self.value),
            _header_value(FIRST_DESTINATION_HEADER, addresses[0]),
        ]
        if auth is not None:  # the endpoint's own key, as the HTTP router sends it
            headers.append(_header_value("authorization", auth[1].decode("latin-1")))
        self.mutation = pb.HeaderMutation(set_headers=headers)
        self.metadata = struct_pb2.Struct()
        lb = self.metadata.fields[LB_NAMESPACE].struct_value
        lb.fields[DESTINATION_HEADER].string_value = self.value
        common = pb.CommonResponse(header_mutation=self.mutation)
        self.headers_response = pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=common), dynamic_metadata=self.metadata
        ).SerializeToString()
        # BUFFERED: the headers are held until the body's answer, which mutates them
        self.body_response = pb.ProcessingResponse(
            request_body=pb.BodyResponse(response=common), dynamic_metadata=self.metadata
        ).SerializeToString()

    @classmethod
    def of(cls, addresses: list[str], auth: tuple[bytes, bytes] | None = None) -> Pick:
        """The (cached) Pick of this fallback list: the protobuf messages of an answer are
        built once per distinct list, not per request."""
        key = (*addresses, auth)
        pick = _PICKS.get(key)
        if pick is None:
            if len(_PICKS) >= _PICK_CACHE_SIZE:
                _PICKS.clear()
            pick = _PICKS[key] = cls(addresses, auth)
        return pick


_PICKS: dict[tuple, Pick] = {}
_SERVED_ANSWERS: dict[tuple[str | None, bool, bool], bytes] = {}


def _served_answer(name: str | None, skip_body: bool, strip: bool = False) -> bytes:
    """The response-headers answer: the header naming the endpoint that served (``None``:
    unknown, nothing set), the gateway's served-address header removed (``strip``), and the
    mode override that skips the response body (built once per endpoint and options)."""
    key = (name, skip_body, strip)
    answer = _SERVED_ANSWERS.get(key)
    if answer is None:
        if len(_SERVED_ANSWERS) >= _PICK_CACHE_SIZE:
            _SERVED_ANSWERS.clear()
        mutation = None
        if name is not None or strip:
            mutation = pb.HeaderMutation(remove_headers=[SERVED_KEY] if strip else [])
            if name is not None:
                mutation.set_headers.append(_header_value(ENDPOINT_HEADER, name))
        out = pb.ProcessingResponse(
            response_headers=pb.HeadersResponse(
                response=pb.CommonResponse(header_mutation=mutation)
            )
        )
        if skip_body:
            out.mode_override.CopyFrom(_SKIP_RESPONSE_BODY)
        answer = _SERVED_ANSWERS[key] = out.SerializeToString()
    return answer


_ID_WIDTH = 16  # an observed pick's id: hex digits of a counter, fixed width
_ID_PLACEHOLDER = "\x7f" * _ID_WIDTH


def _observed_template(name: str) -> tuple[bytes, bytes] | None:
    """The serialized ``dynamic_metadata`` of an observed pick of ``name`` around its id
    (prefix, suffix); appended to the pick's answer (protobuf merges the two messages' metadata).
    None when the placeholder is not found once (a name containing it: built per request)."""
    raw = _observed_metadata(name, _ID_PLACEHOLDER)
    mark = _ID_PLACEHOLDER.encode()
    if raw.count(mark) != 1:
        return None
    i = raw.index(mark)
    return raw[:i], raw[i + _ID_WIDTH :]


def _observed_metadata(name: str, key: str) -> bytes:
    out = pb.ProcessingResponse()
    ns = out.dynamic_metadata.fields[OBSERVER_NAMESPACE].struct_value.fields
    ns["endpoint"].string_value = name
    ns["id"].string_value = key
    return out.SerializeToString()


class Observers:
    """Observed picks whose response report has not come yet, by id: each from its pick until
    the observer stream reports it, or ``linger_s`` after its request ended (the report may
    come just after the picking stream's end, or never: another EPP's observer, an Envoy
    without one); at most ``max_waiting`` (the oldest give way)."""

    def __init__(self, linger_s: float = 10.0, max_waiting: int = 1 << 16) -> None:
        self.linger_s = linger_s
        self.max_waiting = max_waiting
        self.waiting: dict[str, ExtProcStream] = {}
        self._ended: deque[tuple[float, str]] = deque()  # (when to forget, id), in order
        self._count = 0
        self._templates: dict[str, tuple[bytes, bytes] | None] = {}

    def register(self, stream: ExtProcStream, name: str) -> tuple[str, bytes]:
        """A new id for ``stream``'s pick of ``name`` and the metadata its answer carries."""
        self._count += 1
        key = f"{self._count:0{_ID_WIDTH}x}"
        waiting = self.waiting
        if len(waiting) >= self.max_waiting:
            del waiting[next(iter(waiting))]
        waiting[key] = stream
        template = self._templates.get(name, False)
        if template is False:
            if len(self._templates) >= _PICK_CACHE_SIZE:
                self._templates.clear()
            template = self._templates[name] = _observed_template(name)
        if template is None:
            return key, _observed_metadata(name, key)
        return key, template[0] + key.encode() + template[1]

    def ended(self, key: str) -> None:
        """The pick's request is over: forget it ``linger_s`` from now, unless reported."""
        now = time.monotonic()
        ended = self._ended
        ended.append((now + self.linger_s, key))
        waiting = self.waiting
        while ended and ended[0][0] <= now:
            waiting.pop(ended.popleft()[1], None)

    def claim(self, key: str) -> ExtProcStream | None:
        """The picking stream of ``key`` (once: its report is taken)."""
        return self.waiting.pop(key, None)


def _then(pending: Awaitable[T], fn: Callable[[T], R]) -> Awaitable[R]:
    async def run() -> R:
        return fn(await pending)

    return run()


def _is_pending(x: Any) -> bool:
    """An answer still to come (an awaitable), not an answer."""
    return hasattr(x, "__await__")


class ExtProcStream:
    """The state of one ``Process`` stream (one HTTP request through Envoy); on the in-loop
    transport, the call's :class:`~kvserve.cluster.epp.grpc_server.StreamHandler`."""

    __slots__ = (
        "epp", "call", "observed", "observed_key", "extra", "request_mode", "response_mode",
        "body_early", "headers", "path", "body", "body_len", "chunks", "headers_answered",
        "picked", "req", "counted", "first", "t_pick", "partial", "subset",
    )  # fmt: skip

    def __init__(
        self, epp: EndpointPicker, call: Call | None = None, observed: bool = False
    ) -> None:
        self.epp = epp
        self.call = call
        self.observed = observed  # an observer stream reports the response (not this one)
        self.observed_key: str | None = None  # the pick's id there
        # appended to the pick's answer: its observed metadata (b"": ``bytes + b""`` is the
        # same object in CPython, no copy)
        self.extra = b""
        self.request_mode = BUFFERED  # assumed when Envoy sends no protocol_config
        self.response_mode = NONE
        self.body_early = False  # send_body_without_waiting_for_header_response
        self.headers: dict[str, str] = {}  # the request headers the EPP reads
        self.path = "/"  # the request's :path without its query
        self.body: list[bytes] = []
        self.body_len = 0
        self.chunks = 0  # STREAMED chunks received and not answered
        self.headers_answered = False
        self.picked = False
        self.req: RoutingRequest | None = None
        self.counted: Endpoint | None = None  # holds one in-flight count of it
        self.first: Endpoint | None = None  # the pick (then the endpoint that served)
        self.t_pick = 0.0
        self.partial = False  # the body the pick sees is cut short (BUFFERED_PARTIAL)
        self.subset: set[str] | None = None  # the gateway's subset hint, when it gave one

    # ------------------------------------------------------------------ the transport's

    def on_message(self, msg: pb.ProcessingRequest) -> Awaitable[None] | None:
        """Answer ``msg`` on the call now, or return what the answer waits for."""
        out = self.handle(msg)
        if type(out) is list:
            write = self.call.write  # type: ignore[union-attr]
            for answer in out:
                write(answer)
            return None
        return self._write_later(out)  # type: ignore[arg-type]

    async def _write_later(self, pending: Awaitable[list[Answer]]) -> None:
        for answer in await pending:
            self.call.write(answer)  # type: ignore[union-attr]

    def on_end(self) -> None:
        self.release()
        self.epp.streams -= 1
        if self.observed_key is not None:
            self.epp.observers.ended(self.observed_key)

    def _later(self, fn: Callable[..., object], *args: Any) -> None:
        """Work Envoy does not wait for (routing history, metrics): after this message's
        answers are on the wire (the in-loop transport), before the next message is handled."""
        if self.call is None:
            fn(*args)
        else:
            self.call.conn.after_answers(fn, args)

    # ------------------------------------------------------------------ request path

    def handle(self, msg: pb.ProcessingRequest) -> list[Answer] | Awaitable[list[Answer]]:
        """The answers to one message from Envoy, in order: now, or an awaitable of them
        when the pick must wait (a long prompt is tokenized off the loop)."""
        if msg.HasField("protocol_config"):
            cfg = msg.protocol_config
            self.request_mode = cfg.request_body_mode
            self.response_mode = cfg.response_body_mode
            self.body_early = cfg.send_body_without_waiting_for_header_response
        if not self.picked and msg.HasField("metadata_context"):  # (read by the pick only)
            hint = _subset_hint(msg)
            if hint is not None:  # (Envoy may send the metadata with the headers only)
                self.subset = hint
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(msg)
        if kind == "request_body":
            return self._request_body(msg)
        if kind == "request_trailers":
            if self.picked:
                return [_REQUEST_TRAILERS_CONTINUE]
            out = self._finish_request(end_of_stream=False)
            if _is_pending(out):
                return _then(out, lambda answers: [*answers, _REQUEST_TRAILERS_CONTINUE])
            return [*out, _REQUEST_TRAILERS_CONTINUE]  # type: ignore[misc]
        if kind == "response_headers":
            if msg.observability_mode:  # the observer stream's report of a response
                return self._observe(msg)
            return self._response_headers(msg)
        if kind == "response_body":
            return self._response_body(msg.response_body)
        if kind == "response_trailers":
            self.release()
            return [_RESPONSE_TRAILERS_CONTINUE]
        return []

    def _request_headers(self, msg: pb.ProcessingRequest) -> list[Answer] | Awaitable[list[Answer]]:
        headers, wanted = self.headers, self.epp.request_headers
        for h in msg.request_headers.headers.headers:
            key = h.key.lower()
            if key in wanted:
                raw = h.raw_value
                headers[key] = raw.decode("latin-1") if raw else h.value
        core = self.epp.core
        self.path = path = self.headers.get(":path", "/").partition("?")[0]
        if core.needs_key(path) and not core.authorized(self.headers.get("authorization")):
            self.picked = True  # answered: nothing more to pick
            core.metrics.rejected_of(401).inc()
            return [
                immediate(
                    401, "Incorrect API key provided: send `Authorization: Bearer <key>`.",
                    "invalid_request_error", "invalid_api_key",
                    headers=[("www-authenticate", "Bearer")],
                )
            ]  # fmt: skip
        mode = self.request_mode
        deferred = mode == FULL_DUPLEX or (mode == STREAMED and self.body_early)
        if msg.request_headers.end_of_stream or (mode in (NONE, STREAMED) and not deferred):
            # No body, or none the EPP will see before the headers must go: pick on headers.
            result = self._pick(b"")
            if _is_pending(result):
                return _then(result, self._answer_on_headers)
            return self._answer_on_headers(result)  # type: ignore[arg-type]
        if deferred:
            return []
        self.headers_answered = True  # BUFFERED: held by Envoy until the body's answer
        return [_REQUEST_HEADERS_CONTINUE]

    def _answer_on_headers(self, result: Pick | pb.ProcessingResponse) -> list[Answer]:
        if type(result) is not Pick:
            return [result]
        self.headers_answered = True
        return [result.headers_response + self.extra]

    def _request_body(self, msg: pb.ProcessingRequest) -> list[Answer] | Awaitable[list[Answer]]:
        b = msg.request_body
        if self.picked:  # STREAMED after a pick on headers: pass the chunk on
            return [_REQUEST_BODY_CONTINUE]
        chunk = b.body  # (each read of the field copies it out of the message)
        if chunk:
            self.body.append(chunk)
            self.body_len += len(chunk)
            if self.body_len > self.epp.max_body_bytes:
                self.epp.core.metrics.rejected_of(413).inc()
                return [
                    immediate(
                        413, f"request body over the limit of {self.epp.max_body_bytes} bytes",
                        "invalid_request_error",
                    )
                ]  # fmt: skip
        self.chunks += 1
        if b.end_of_stream or self.request_mode in (BUFFERED, BUFFERED_PARTIAL):
            self.partial = not b.end_of_stream  # BUFFERED_PARTIAL: over Envoy's buffer
            return self._finish_request(end_of_stream=True)
        return []

    def _finish_request(self, end_of_stream: bool) -> list[Answer] | Awaitable[list[Answer]]:
        """The whole body is here: pick, then answer what Envoy waits for."""
        data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        result = self._pick(data)
        if _is_pending(result):
            return _then(result, lambda r: self._answer_pick(r, data, end_of_stream))
        return self._answer_pick(result, data, end_of_stream)  # type: ignore[arg-type]

    def _answer_pick(
        self, result: Pick | pb.ProcessingResponse, data: bytes, end_of_stream: bool
    ) -> list[Answer]:
        if type(result) is not Pick:
            return [result]
        if self.headers_answered:  # BUFFERED: the headers are still held; mutate them now
            return [result.body_response + self.extra]
        self.headers_answered = True
        out = [result.headers_response + self.extra]
        if self.request_mode == FULL_DUPLEX:
            out += _echo(data, end_of_stream, request=True)
        else:  # STREAMED: continue every chunk as it came
            out += [_REQUEST_BODY_CONTINUE] * self.chunks
        self.body = []
        self.chunks = 0
        return out

    def _pick(
        self, data: bytes
    ) -> Pick | pb.ProcessingResponse | Awaitable[Pick | pb.ProcessingResponse]:
        """Ask the scheduling core; a :class:`Pick`, or an immediate error response (or an
        awaitable of either, when the prompt is tokenized off the loop)."""
        epp = self.epp
        core = epp.core
        metrics = core.metrics
        t0 = time.perf_counter()
        self.picked = True
        chat = _COMPLETION_PATHS.get(self.path)
        endpoints = list(core.pool.endpoints.values())
        subset = self.subset
        if subset is not None:
            endpoints = [e for e in endpoints if epp.address_of(e) in subset]
            if not endpoints:
                metrics.rejected_of(503).inc()
                return immediate(
                    503, "no endpoint of the gateway's subset hint is known to the picker",
                    "service_unavailable", retry_after=core.config.retry_after_s,
                )  # fmt: skip
        body = None
        if chat is not None and data:
            try:
                body = _json_decode(data)
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
                if not self.partial:  # (a BUFFERED_PARTIAL body cut short: pick by load)
                    metrics.rejected_of(400).inc()
                    return immediate(400, "request body is not valid JSON", "invalid_request_error")
            if body is not None and not isinstance(body, dict):
                metrics.rejected_of(400).inc()
                return immediate(400, "request body must be a JSON object", "invalid_request_error")
        try:
            if chat is None or body is None:  # not a completion (or no body): pick by load
                req = RoutingRequest(seed=core.config.prefix_hash_seed)
                decided = req, core.scheduler.schedule(req, endpoints)
            else:
                session = self.headers.get(epp.session_header)
                decided = core.decide_now(body, chat, session, endpoints, split=False)
                if decided is None:  # a long prompt: tokenized and hashed off the loop
                    return self._pick_later(
                        core.decide(body, chat, session, endpoints, split=False), t0
                    )
        except (BadRequestError, NoEndpointError) as e:
            return self._refused(e)
        return self._picked(*decided, t0)

    async def _pick_later(
        self, deciding: Awaitable[tuple[RoutingRequest, Decision]], t0: float
    ) -> Pick | pb.ProcessingResponse:
        try:
            req, decision = await deciding
        except (BadRequestError, NoEndpointError) as e:
            return self._refused(e)
        return self._picked(req, decision, t0)

    def _refused(self, e: BadRequestError | NoEndpointError) -> pb.ProcessingResponse:
        core = self.epp.core
        if isinstance(e, BadRequestError):
            core.metrics.rejected_of(400).inc()
            return immediate(400, str(e), "invalid_request_error")
        core.metrics.rejected_of(e.status).inc()
        if e.status == 404:
            return immediate(404, e.message, "invalid_request_error", "model_not_found")
        return immediate(
            e.status, e.message, "service_unavailable", retry_after=core.config.retry_after_s
        )

    def _picked(
        self, req: RoutingRequest, decision: Decision, t0: float
    ) -> Pick | pb.ProcessingResponse:
        """The fallback list of a decision: its first endpoint counts one more in flight."""
        epp = self.epp
        core = epp.core
        metrics = core.metrics
        ranked = [e for e in decision.ranked if e.healthy][: core.config.max_attempts]
        ranked = [e for e in ranked if e.in_flight < epp.max_in_flight]
        if not ranked:
            metrics.rejected_of(429).inc()
            return immediate(
                429,
                "every endpoint is at its limit of requests in flight; retry later",
                "rate_limit_exceeded",
                retry_after=core.config.retry_after_s,
            )
        first = ranked[0]
        first.in_flight += 1
        self.counted = self.first = first
        if self.observed:
            self.observed_key, self.extra = epp.observers.register(self, first.name)
        self.req = req
        self.t_pick = t = time.perf_counter()
        self._later(_observe_pick, core, req, first, decision.reason, t - t0)
        address_of = epp.address_of
        return Pick.of([address_of(e) for e in ranked], first.auth_header)

    # ------------------------------------------------------------------ response path

    def _response_headers(self, msg: pb.ProcessingRequest) -> list[Answer]:
        status, length, event_stream, header = _read_response_headers(msg)
        name = self._answered(msg, status, header, self._later)
        if msg.response_headers.end_of_stream or (length and not event_stream):
            # An answer with a length comes from an engine that has finished the request.
            self.release()
        # Any other (an event stream) is released when the ext_proc stream ends: Envoy ends
        # it when the HTTP request does (the stream's last event sent, or the client gone).
        # Either way Envoy is asked (``allow_mode_override``) not to send the body through
        # here: one message less each way for an answer, one round trip less per event of a
        # stream, where Envoy honours it (its counters show the body still comes with a
        # FULL_DUPLEX_STREAMED request: it is continued).
        return [_served_answer(name, self.response_mode != NONE, header is not None)]

    def _observe(self, msg: pb.ProcessingRequest) -> list[Answer]:
        """An observer stream's response headers (nothing is answered: Envoy does not wait):
        the picking stream of the id they carry learns from them; its count stays with it
        (released when Envoy ends that stream, with the HTTP request). The observer stream
        is left for Envoy to end (``deferred_close_timeout`` after the request): ending it
        here at its report measured slower (the picking streams' exchanges too) and ~0.1 ms
        more CPU per request in both processes (benchmarks/results/epp_2026-12-02i.md and
        -02j.md, against -02h.md: one run each way round, on a noisy machine)."""
        ns = msg.metadata_context.filter_metadata.get(OBSERVER_NAMESPACE)
        key = ns.fields.get("id") if ns is not None else None
        picker = None if key is None else self.epp.observers.claim(key.string_value)
        if picker is not None:  # (else another EPP's pick, or one long over)
            status, _, _, header = _read_response_headers(msg)
            picker._answered(msg, status, header, self._later)
        return []

    def _answered(
        self,
        msg: pb.ProcessingRequest,
        status: int,
        header: str | None,
        later: Callable[..., None],
    ) -> str | None:
        """What response headers teach: the endpoint that served (its name, or None), its
        status and first-byte metrics, a probe of the pick when Envoy answered 502-504 itself;
        ``later``: how bookkeeping is run after the answers (the stream that got them)."""
        core = self.epp.core
        served = self._learn_served(msg, header, later)
        if served is None and self.first is not None:
            if status in (502, 503, 504):
                # No upstream answered (Envoy's own reply: refused, reset): check it now.
                core.pool.probe_soon(self.first)
            elif header is None and not self._reported(msg):
                served = self.first  # the gateway reports nothing: assume the pick served
        if served is None:
            return None
        served.answered_at = time.monotonic()
        first_byte = time.perf_counter() - self.t_pick
        later(_observe_served, core.metrics, served.name, status, first_byte)
        return served.name

    @staticmethod
    def _served_address(msg: pb.ProcessingRequest, header: str | None = None) -> str:
        lb = msg.metadata_context.filter_metadata.get(LB_NAMESPACE)
        if lb is not None and SERVED_KEY in lb.fields:
            return lb.fields[SERVED_KEY].string_value
        if header:
            return header.strip()
        if _EXT_PROC_ATTRS in msg.attributes:
            value = msg.attributes[_EXT_PROC_ATTRS].fields.get("upstream.address")
            if value is not None:
                return value.string_value
        return ""

    @staticmethod
    def _reported(msg: pb.ProcessingRequest) -> bool:
        """Whether the gateway reports served endpoints at all (metadata or attribute)."""
        lb = msg.metadata_context.filter_metadata.get(LB_NAMESPACE)
        return (lb is not None and SERVED_KEY in lb.fields) or _EXT_PROC_ATTRS in msg.attributes

    def _learn_served(
        self,
        msg: pb.ProcessingRequest,
        header: str | None,
        later: Callable[..., None],
    ) -> Endpoint | None:
        """The endpoint that served the request, if reported (the in-flight count moves
        there when it is not the pick, if still held); ``header``: the gateway's
        served-address header."""
        address = self._served_address(msg, header)
        if not address:
            return None
        served = self.epp.endpoint_at(address)
        if served is None or self.first is None:
            return served
        if served is not self.first:  # Envoy went elsewhere (a fallback): follow it
            if self.counted is not None:
                self.counted.in_flight -= 1
                served.in_flight += 1
                self.counted = served
            self.first = served
            self.epp.core.metrics.decisions_of("failover").inc()
            if self.req is not None:
                later(self.epp.core.scheduler.observe, self.req, served)
        return served

    def _response_body(self, b: pb.HttpBody) -> list[Answer]:
        if b.end_of_stream:
            self.release()
        if self.response_mode == FULL_DUPLEX:
            return _echo(b.body, b.end_of_stream, request=False)
        return [_RESPONSE_BODY_CONTINUE]

    def release(self) -> None:
        """Give back the in-flight count (idempotent: response end, or stream end/break)."""
        ep, self.counted = self.counted, None
        if ep is not None:
            ep.in_flight -= 1
            latency = self.epp.core.metrics.latency_of(ep.name)
            self._later(latency.observe, time.perf_counter() - self.t_pick)


def _read_response_headers(msg: pb.ProcessingRequest) -> tuple[int, bool, bool, str | None]:
    """(status, has a content-length, is an event stream, the served-address header)."""
    status, length, event_stream, header = 0, False, False, None
    for h in msg.response_headers.headers.headers:
        key = h.key
        if key == ":status":
            status = int((h.raw_value or h.value.encode()).decode() or 0)
        elif key == "content-length":
            length = True
        elif key == "content-type":
            event_stream = (h.raw_value or h.value.encode()).startswith(b"text/event-stream")
        elif key == SERVED_KEY:
            header = (h.raw_value or h.value.encode()).decode("latin-1")
    return status, length, event_stream, header


def _observe_pick(
    core: Router, req: RoutingRequest, first: Endpoint, reason: str, seconds: float
) -> None:
    """A pick's bookkeeping: the stateful scorers learn where it went; metrics."""
    core.scheduler.observe(req, first)
    core.metrics.decisions_of(reason).inc()
    core.metrics.routing_time.observe(seconds)


def _observe_served(metrics: RouterMetrics, name: str, status: int, first_byte: float) -> None:
    metrics.requests_of(name, status).inc()
    metrics.first_byte_of(name).observe(first_byte)


def _echo(data: bytes, end_of_stream: bool, request: bool) -> list[pb.ProcessingResponse]:
    """``data`` sent back in streamed-response pieces (the full-duplex body contract)."""
    pieces = [data[i : i + ECHO_CHUNK] for i in range(0, len(data), ECHO_CHUNK)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        last = end_of_stream and i == len(pieces) - 1
        mutation = pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=piece, end_of_stream=last)
        )
        body = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
        out.append(
            pb.ProcessingResponse(request_body=body)
            if request
            else pb.ProcessingResponse(response_body=body)
        )
    return out


def _subset_hint(msg: pb.ProcessingRequest) -> set[str] | None:
    """The gateway's subset hint (``ip:port`` strings), or None when it gave none."""
    ns = msg.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value: Any = ns.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return {v.string_value for v in value.list_value.values}
    if kind == "string_value":
        return {s.strip() for s in value.string_value.split(",") if s.strip()}
    return set()
