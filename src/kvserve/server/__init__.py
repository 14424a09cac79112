"""kvserve.server: the OpenAI-compatible HTTP API of one engine.

- ``protocol``: request/response wire models (pydantic).
- ``serving``: completions and chat completions over an ``AsyncEngine`` (validation, n fan-out,
  SSE chunks, usage with the prefix-cache breakdown).
- ``api_server``: ``build_app(async_engine, config)``, the FastAPI app (routes, request bodies,
  error mapping, /health, /metrics, /v1/models, /openapi.json).
- ``limits``: what one request may ask for (body size, prompt characters, amplification).
- ``admission``: the bounded queue in front of the engine (429 with Retry-After).
- ``auth``: API keys (``--api-key``, ``VLLM_API_KEY``) and the bearer check.
- ``tokenizer_pool`` / ``tokenizer_worker``: tokenization of large inputs in worker processes.
- ``http_protocol``: uvicorn's HTTP/1.1 protocol with a header timeout, ignoring h2c upgrades.
- ``metrics``: Prometheus metrics with vLLM's names.
- ``errors``: OpenAI-style error bodies.
- ``cli``: ``kvserve serve``.

It must not reach into the scheduler or the model: the engine is used through ``AsyncEngine``.
"""
