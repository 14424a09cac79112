"""The names kvserve's front ends and a gateway agree on: request and response headers, and
the dynamic-metadata namespaces of the Endpoint Picker protocol (Gateway API Inference
Extension, Envoy ext_proc). One place for both sides: the EPP and the HTTP router that set
and read them, and the Envoy configuration and load generator that must use the same."""

from __future__ import annotations

# Who served a request, on every answer to the client (the HTTP router's, and the EPP's
# through the gateway).
ENDPOINT_HEADER = "x-kvserve-endpoint"

# The pick: an ordered fallback list ``ip:port,...`` (the extension's header and the
# ``envoy.lb`` metadata key), and its first address alone for a gateway that connects to one
# address and walks no list (plain Envoy's ORIGINAL_DST cluster reads it).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
FIRST_DESTINATION_HEADER = "x-kvserve-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
# The endpoint that served, as the gateway reports it (``envoy.lb`` metadata or a response
# header the gateway adds and the EPP removes).
SERVED_KEY = "x-gateway-destination-endpoint-served"
# The gateway's subset hint: the endpoints a pick may come from.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

# Observed responses: the picking stream's gRPC metadata, and the pick's dynamic metadata
# namespace ({"id": key of the pick, "endpoint": its first endpoint's name}) that Envoy
# returns with the observer stream's messages.
OBSERVED_METADATA = "x-kvserve-observed"
OBSERVER_NAMESPACE = "kvserve"

# The headers the EPP reads, of a request (besides the router's session header) and of an
# answer: a gateway may send it only these (Envoy's ext_proc ``forward_rules``).
REQUEST_HEADERS_READ = (":path", "authorization")
RESPONSE_HEADERS_READ = (":status", "content-length", "content-type", SERVED_KEY)
