"""The ext_proc message sequence, message by message, on a real scheduling core (a Router whose
endpoints are loaded and marked healthy; nothing listens: no request leaves the process).

What Envoy does end to end is in test_epp.py; here are the cases a plain Envoy does not
produce: a gateway reporting that another endpoint of the fallback list served, the
subset hint as a list, a body over the limit, and the order of answers in each body mode."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from kvserve.bench.envoy import EnvoySpec, bootstrap
from kvserve.cluster.config import EndpointSpec, RouterConfig
from kvserve.cluster.epp.processor import BUFFERED, FULL_DUPLEX, ExtProcStream, Observers
from kvserve.cluster.epp.server import EndpointPicker
from kvserve.cluster.gateway import Router
from kvserve.cluster.headers import (
    DESTINATION_HEADER,
    FIRST_DESTINATION_HEADER,
    LB_NAMESPACE,
    OBSERVER_NAMESPACE,
    REQUEST_HEADERS_READ,
    RESPONSE_HEADERS_READ,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)

A, B = "127.0.0.1:18001", "127.0.0.1:18002"


def _picker(**config) -> EndpointPicker:
    cfg = RouterConfig(
        endpoints=[
            EndpointSpec(url=f"http://{a}", model="m", name=n) for a, n in ((A, "a"), (B, "b"))
        ],
        **config,
    )
    epp = EndpointPicker(Router(cfg), port=0)
    epp.core.pool.load()
    for ep in epp.core.pool.endpoints.values():
        ep.healthy = True
    return epp


def _headers(
    path: str = "/v1/completions", eos: bool = False, mode=FULL_DUPLEX, md: dict | None = None
):
    hs = [(":path", path), (":method", "POST"), ("content-type", "application/json")]
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]
            ),
            end_of_stream=eos,
        ),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=1),
    )
    for ns, fields in (md or {}).items():
        s = struct_pb2.Struct()
        s.update(fields)
        msg.metadata_context.filter_metadata[ns].CopyFrom(s)
    return msg


async def _handle(s: ExtProcStream, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    """The stream's answers to ``msg`` as messages (it answers now or later; the answers that
    recur come serialized)."""
    out = s.handle(msg)
    if not isinstance(out, list):
        out = await out
    return [pb.ProcessingResponse.FromString(a) if isinstance(a, bytes) else a for a in out]


def _body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def _destination(out: list[pb.ProcessingResponse]) -> str:
    common = (
        out[0].request_headers.response
        if out[0].HasField("request_headers")
        else out[0].request_body.response
    )
    headers = {
        h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
    }
    assert set(headers) == {DESTINATION_HEADER, FIRST_DESTINATION_HEADER}
    value = headers[DESTINATION_HEADER]
    meta = out[0].dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
    assert meta[DESTINATION_HEADER].string_value == value  # header and metadata agree
    assert headers[FIRST_DESTINATION_HEADER] == value.split(",")[0]  # for a one-address gateway
    return value


def _served(
    address: str, end: bool = False, length: bool = False, as_header: bool = False
) -> pb.ProcessingRequest:
    """Response headers, the gateway reporting the served ``address`` in the ``envoy.lb``
    metadata (or, ``as_header``, in a response header of the same name)."""
    hs = [(":status", b"200")] + [("content-length", b"17")] * length
    hs += [(SERVED_KEY, address.encode())] * as_header
    msg = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in hs]
            ),
            end_of_stream=end,
        )
    )
    if not as_header:
        s = struct_pb2.Struct()
        s.update({SERVED_KEY: address})
        msg.metadata_context.filter_metadata[LB_NAMESPACE].CopyFrom(s)
    return msg


BODY = msgspec.json.encode({"model": "m", "prompt": list(range(40)), "max_tokens": 1})


def test_full_duplex_pick_echo_and_served_elsewhere_moves_the_count():
    async def run() -> None:
        epp = _picker()
        eps = {e.name: e for e in epp.core.pool.endpoints.values()}
        s = ExtProcStream(epp)
        assert await _handle(s, _headers()) == []  # full duplex: wait for the body
        assert await _handle(s, _body(BODY[:10], False)) == []
        out = await _handle(s, _body(BODY[10:], True))
        first, second = _destination(out).split(",")
        assert {first, second} == {A, B}
        echoed = b"".join(
            o.request_body.response.body_mutation.streamed_response.body for o in out[1:]
        )
        assert echoed == BODY
        assert out[-1].request_body.response.body_mutation.streamed_response.end_of_stream
        picked = epp.endpoint_at(first)
        other = epp.endpoint_at(second)
        assert (picked.in_flight, other.in_flight) == (1, 0)
        # The gateway fell back to the second address: the count follows it.
        (resp,) = await _handle(s, _served(second))
        (h,) = resp.response_headers.response.header_mutation.set_headers
        assert h.header.raw_value.decode() == other.name
        assert (picked.in_flight, other.in_flight) == (0, 1)
        await _handle(
            s, pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x", end_of_stream=True))
        )
        assert all(e.in_flight == 0 for e in eps.values())
        s.release()  # the stream's end after the response's: nothing more to give back
        assert all(e.in_flight == 0 for e in eps.values())

    asyncio.run(run())


def test_a_served_address_header_moves_the_count_and_is_removed():
    """Plain Envoy reports the served endpoint as a response header (the route adds the
    upstream's address): the EPP learns it there like the metadata, and removes the header
    so that the client never sees an engine's address."""

    async def run() -> None:
        epp = _picker()
        s = ExtProcStream(epp)
        await _handle(s, _headers(mode=BUFFERED))
        first, second = _destination(await _handle(s, _body(BODY, True))).split(",")
        picked, other = epp.endpoint_at(first), epp.endpoint_at(second)
        assert (picked.in_flight, other.in_flight) == (1, 0)
        (resp,) = await _handle(s, _served(second, as_header=True))  # it went to the fallback
        mutation = resp.response_headers.response.header_mutation
        assert list(mutation.remove_headers) == [SERVED_KEY]
        (h,) = mutation.set_headers
        assert h.header.raw_value.decode() == other.name
        assert (picked.in_flight, other.in_flight) == (0, 1)
        s.release()
        assert (picked.in_flight, other.in_flight) == (0, 0)

    asyncio.run(run())


def test_buffered_answers_headers_then_picks_on_the_body():
    async def run() -> None:
        epp = _picker()
        s = ExtProcStream(epp)
        (h,) = await _handle(s, _headers(mode=BUFFERED))
        assert not h.request_headers.response.HasField("header_mutation")  # held, continued
        out = await _handle(s, _body(BODY, True))
        assert len(out) == 1 and len(_destination(out).split(",")) == 2
        s.release()  # the stream broke before any response: the count comes back
        assert all(e.in_flight == 0 for e in epp.core.pool.endpoints.values())

    asyncio.run(run())


def test_subset_hint_as_a_list_and_a_body_over_the_limit():
    async def run() -> None:
        epp = _picker(max_body_bytes=64)
        s = ExtProcStream(epp)
        hint = {SUBSET_KEY: [B]}
        assert await _handle(s, _headers(md={SUBSET_NAMESPACE: hint})) == []
        # over the limit of 64 bytes: 413 before any pick
        (r,) = await _handle(s, _body(BODY, False))
        assert r.immediate_response.status.code == 413
        assert b"limit" in r.immediate_response.body
        s = ExtProcStream(_picker())
        await _handle(s, _headers(md={SUBSET_NAMESPACE: hint}))
        out = await _handle(s, _body(BODY, True))
        assert _destination(out) == B  # only the hinted endpoint
        s = ExtProcStream(_picker())
        await _handle(s, _headers(md={SUBSET_NAMESPACE: {SUBSET_KEY: []}}))
        (r,) = await _handle(s, _body(BODY, True))
        assert r.immediate_response.status.code == 503

    asyncio.run(run())


def test_a_request_without_body_is_picked_on_its_headers():
    async def run() -> None:
        epp = _picker()
        s = ExtProcStream(epp)
        out = await _handle(s, _headers(path="/v1/models", eos=True))
        assert len(_destination(out).split(",")) == 2
        (resp,) = await _handle(s, _served(_destination(out).split(",")[0], end=True))
        assert resp.HasField("response_headers")
        assert all(e.in_flight == 0 for e in epp.core.pool.endpoints.values())

    asyncio.run(run())


def test_an_answer_with_a_length_is_released_at_its_headers_and_its_body_skipped():
    async def run() -> None:
        epp = _picker()
        s = ExtProcStream(epp)
        await _handle(s, _headers())
        first = _destination(await _handle(s, _body(BODY, True))).split(",")[0]
        assert epp.endpoint_at(first).in_flight == 1
        (resp,) = await _handle(s, _served(first, length=True))
        assert resp.HasField("mode_override")  # response body NONE: it skips the EPP
        assert resp.mode_override.response_body_mode == 0
        assert epp.endpoint_at(first).in_flight == 0  # the engine has finished it

    asyncio.run(run())


def test_the_answers_are_built_once_and_never_changed():
    """The pick's answer (header mutation, ``envoy.lb`` metadata) is serialized once per
    fallback list, and the response-headers answer once per served endpoint: no protobuf
    building per request, and a later answer (a response header, a mode override) does not
    leak into a cached one. A short prompt is answered synchronously (no task, no await)."""
    epp = _picker()
    picks, served = [], []
    for _ in range(2):
        s = ExtProcStream(epp)
        s.handle(_headers(mode=BUFFERED))
        (pick,) = s.handle(_body(BODY, True))  # a list now: answered in the caller's turn
        first = _destination([pb.ProcessingResponse.FromString(pick)]).split(",")[0]
        (answer,) = s.handle(_served(first, length=True))
        picks.append(pick)
        served.append(answer)
    assert picks[0] is picks[1] and served[0] is served[1]  # the same prebuilt bytes
    pick = pb.ProcessingResponse.FromString(picks[0])
    assert pick.HasField("request_body") and not pick.HasField("mode_override")
    assert _destination([pick]).count(",") == 1  # both endpoints, in order
    answer = pb.ProcessingResponse.FromString(served[0])
    assert answer.response_headers.response.header_mutation.set_headers
    assert answer.HasField("mode_override")
    assert all(e.in_flight == 0 for e in epp.core.pool.endpoints.values())


def test_gateways_forward_only_the_headers_the_epp_reads():
    """The harness's Envoy and the envoy-gateway overlay send the EPP just the headers it
    reads (ext_proc ``forward_rules``: ~0.04 ms of Envoy's CPU per request); a session header
    other than the router's default must be added there, as the overlay says."""
    reads = {*REQUEST_HEADERS_READ, RouterConfig().session_header, *RESPONSE_HEADERS_READ}
    assert _picker().request_headers <= reads

    def forwarded(config: dict) -> set[str]:
        (hcm,) = [
            f["typed_config"]
            for lis in config["static_resources"]["listeners"]
            for chain in lis["filter_chains"]
            for f in chain["filters"]
            if any(
                h["name"] == "envoy.filters.http.ext_proc"
                for h in f["typed_config"]["http_filters"]
            )
        ]
        (ext_proc,) = [h for h in hcm["http_filters"] if h["name"] == "envoy.filters.http.ext_proc"]
        rules = ext_proc["typed_config"]["forward_rules"]["allowed_headers"]["patterns"]
        return {p["exact"] for p in rules}

    assert forwarded(bootstrap(EnvoySpec(("127.0.0.1", 9002)), 1, 2, 3)) == reads
    overlay = Path(__file__).parents[2] / "deploy/overlays/envoy-gateway/envoy.yaml"
    assert forwarded(yaml.safe_load(overlay.read_text())) == reads


def _report(key: str, status: int = 200, served: str | None = None) -> pb.ProcessingRequest:
    """An observer stream's message (Envoy's observability mode): the response headers, with
    the pick's ``kvserve`` metadata and the served-address header when ``served``."""
    hs = [(":status", str(status).encode()), ("content-type", b"text/event-stream")]
    hs += [(SERVED_KEY, served.encode())] if served else []
    msg = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in hs]
            )
        ),
        observability_mode=True,
    )
    ns = struct_pb2.Struct()
    ns.update({"id": key, "endpoint": "whatever"})
    msg.metadata_context.filter_metadata[OBSERVER_NAMESPACE].CopyFrom(ns)
    return msg


def _metric(epp: EndpointPicker, name: str, **labels: str) -> float:
    return epp.core.metrics.registry.get_sample_value(name, labels) or 0.0


def test_an_observed_pick_carries_its_id_and_the_report_moves_its_count():
    """Observe mode: the pick's answer also carries the ``kvserve`` metadata (its id, the first
    endpoint's name, for the route's x-kvserve-endpoint) on top of the cached pick; the
    observer stream's report (answered with nothing) finds the pick by that id, moves the
    count to the endpoint that served, counts its status there; the picking stream's end
    releases it; a second report of the same id, or one of an unknown id, changes nothing."""

    async def run() -> None:
        epp = _picker()
        s = ExtProcStream(epp, observed=True)
        await _handle(s, _headers(mode=BUFFERED))
        out = await _handle(s, _body(BODY, True))
        first, second = _destination(out).split(",")
        meta = out[0].dynamic_metadata.fields[OBSERVER_NAMESPACE].struct_value.fields
        picked, other = epp.endpoint_at(first), epp.endpoint_at(second)
        assert meta["endpoint"].string_value == picked.name
        key = meta["id"].string_value
        assert len(key) == 16 and epp.observers.waiting[key] is s
        s2 = ExtProcStream(epp, observed=True)  # the next pick: another id, same cached pick
        await _handle(s2, _headers(mode=BUFFERED))
        meta2 = (await _handle(s2, _body(BODY, True)))[0].dynamic_metadata.fields
        key2 = meta2[OBSERVER_NAMESPACE].struct_value.fields["id"].string_value
        assert key2 != key
        s2.on_end()  # (never reported: kept a while)
        assert (picked.in_flight, other.in_flight) == (1, 0)
        observer = ExtProcStream(epp)
        assert await _handle(observer, _report(key, served=second)) == []  # no answer
        assert (picked.in_flight, other.in_flight) == (0, 1)  # it went to the fallback
        assert _metric(epp, "kvserve_router_routing_decisions_total", reason="failover") == 1
        await asyncio.sleep(0)  # (bookkeeping after the answers)
        assert _metric(epp, "kvserve_router_requests_total", endpoint=other.name, status="200") == 1
        assert await _handle(observer, _report(key, served=first)) == []  # taken: ignored
        assert await _handle(observer, _report("0" * 16, served=first)) == []
        assert (picked.in_flight, other.in_flight) == (0, 1)
        s.on_end()  # Envoy ends the picking stream with the HTTP request
        assert (picked.in_flight, other.in_flight) == (0, 0)
        assert list(epp.observers.waiting) == [key2]

    asyncio.run(run())


def test_a_report_after_the_picking_streams_end_still_counts():
    """The report may come after the picking stream ended (a short answer: Envoy ends that
    stream as the answer completes, the observer's opens as its headers pass): the pick is
    kept a while for it, and its status still counts (the probe after Envoy's own 502-504,
    which needs a live pool, is in test_epp.py)."""

    async def run() -> None:
        epp = _picker()
        s = ExtProcStream(epp, observed=True)
        await _handle(s, _headers(mode=BUFFERED))
        out = await _handle(s, _body(BODY, True))
        first = epp.endpoint_at(_destination(out).split(",")[0])
        key = out[0].dynamic_metadata.fields[OBSERVER_NAMESPACE].struct_value.fields["id"]
        s.on_end()
        assert first.in_flight == 0 and key.string_value in epp.observers.waiting
        assert await _handle(ExtProcStream(epp), _report(key.string_value, 429)) == []
        await asyncio.sleep(0)
        assert _metric(epp, "kvserve_router_requests_total", endpoint=first.name, status="429")
        assert first.in_flight == 0 and not epp.observers.waiting

    asyncio.run(run())


def test_observers_forget_picks_never_reported():
    """A pick whose report never comes (another EPP's observer, an Envoy without one) is
    forgotten ``linger_s`` after its request ended; at most ``max_waiting`` are kept."""
    epp = _picker()
    table = Observers(linger_s=0.0, max_waiting=3)
    streams = [ExtProcStream(epp) for _ in range(5)]
    keys = [table.register(st, "a")[0] for st in streams]
    assert list(table.waiting) == keys[2:]  # the oldest gave way
    table.ended(keys[2])
    table.ended(keys[3])  # (each end forgets what is due)
    assert list(table.waiting) == [keys[4]]
    assert table.claim(keys[4]) is streams[4] and table.claim(keys[4]) is None
    # The metadata is the same however it is built (a name holding the id's placeholder).
    for name in ("a", "\x7f" * 20):
        key, raw = table.register(streams[0], name)
        ns = pb.ProcessingResponse.FromString(raw).dynamic_metadata.fields[OBSERVER_NAMESPACE]
        assert ns.struct_value.fields["id"].string_value == key
        assert ns.struct_value.fields["endpoint"].string_value == name
