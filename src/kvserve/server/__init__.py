"""kvserve.server: the OpenAI-compatible HTTP API of one engine.

- ``protocol``: request/response wire models (pydantic).
- ``serving``: completions and chat completions over an ``AsyncEngine`` (validation, n fan-out,
  SSE chunks, usage with the prefix-cache breakdown).
- ``api_server``: ``build_app(async_engine, config)``, the FastAPI app (routes, error mapping,
  /health, /metrics, /v1/models).
- ``metrics``: Prometheus metrics with vLLM's names.
- ``errors``: OpenAI-style error bodies.
- ``cli``: ``kvserve serve``.

It must not reach into the scheduler or the model: the engine is used through ``AsyncEngine``.
"""
