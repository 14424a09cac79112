"""The router as a Gateway API Inference Extension Endpoint Picker (Envoy ext_proc).

A front end of the scheduling core (:class:`~kvserve.cluster.gateway.Router`), like the HTTP
gateway: it only translates Envoy's external-processing protocol into routing requests and
picks into ``x-gateway-destination-endpoint``; it must not score, pick or count by itself.
"""
