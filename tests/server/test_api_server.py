"""The OpenAI-compatible API through the official `openai` client against a real server."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog because"
# Long enough to fill several 16-token blocks.
LONG_PROMPT = (
    "A prefix cache keeps the key and value tensors of earlier prompts in fixed-size blocks, "
    "so that a second request with the same beginning can skip recomputing them entirely."
)


MAX_LEN = 256  # the served engine's max_model_len (conftest.MAX_MODEL_LEN)


def greedy(**kw):
    return dict(temperature=0, **kw)


def assert_tokens_spell(served, tokens: list[str], text: str) -> None:
    """Per-token strings spell the text, except special tokens (shown in logprobs, skipped in
    the text) and tokens holding part of a UTF-8 character (alone they decode to U+FFFD; the
    text holds the character back until it is complete)."""
    tok = served.engine.tokenizer
    special = {tok.decode([i], skip_special_tokens=False) for i in tok.all_special_ids}
    joined = "".join(t for t in tokens if t not in special)
    if "\ufffd" in joined:
        assert text.startswith(joined.split("\ufffd")[0])
    else:
        assert joined == text


def parse_metrics(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric(served, name: str, labels: str = "") -> float:
    with served.http() as http:
        values = parse_metrics(http.get("/metrics").text)
    key = f'{name}{{{labels}model_name="{served.model}"}}'
    if key not in values:  # label order as rendered by prometheus_client
        key = f'{name}{{model_name="{served.model}"{"," + labels.rstrip(",") if labels else ""}}}'
    return values[key]


# -- completions ------------------------------------------------------------------------------


def test_completion_non_streaming_equals_streaming(served):
    client = served.client()
    ids = served.engine.tokenizer.encode(PROMPT)
    resp = client.completions.create(
        model=served.model,
        prompt=PROMPT,
        max_tokens=12,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    assert resp.object == "text_completion" and resp.model == served.model
    [choice] = resp.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == len(ids) + 12

    chunks = list(
        client.completions.create(
            model=served.model,
            prompt=PROMPT,
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
            **greedy(),
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)

    # The same prompt as token ids gives the same greedy text.
    by_ids = client.completions.create(
        model=served.model, prompt=ids, max_tokens=12, extra_body={"ignore_eos": True}, **greedy()
    )
    assert by_ids.choices[0].text == choice.text


def test_completion_stream_include_usage(served):
    chunks = list(
        served.client().completions.create(
            model=served.model,
            prompt=PROMPT,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **greedy(),
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == len(served.engine.tokenizer.encode(PROMPT))
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_batch_and_n(served):
    client = served.client()
    prompts = [PROMPT, "Once upon a time"]
    singles = [
        client.completions.create(model=served.model, prompt=p, max_tokens=6, **greedy())
        .choices[0]
        .text
        for p in prompts
    ]
    resp = client.completions.create(
        model=served.model, prompt=prompts, max_tokens=6, n=2, **greedy()
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in resp.choices}
    # Choice index = prompt index * n + j (OpenAI); greedy choices equal the single requests.
    assert [by_index[0], by_index[1]] == [singles[0]] * 2
    assert [by_index[2], by_index[3]] == [singles[1]] * 2
    tok = served.engine.tokenizer
    assert resp.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)


def test_concurrent_clients_are_batched_and_get_their_own_answers(served):
    client = served.client()
    prompts = [f"Request number {i} asks about" for i in range(6)]

    def complete(prompt: str, stream: bool) -> str:
        kw = dict(model=served.model, prompt=prompt, max_tokens=8, **greedy())
        if not stream:
            return client.completions.create(**kw).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))

    sequential = [complete(p, False) for p in prompts]
    steps_before = served.async_engine.num_steps
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, p, i % 2 == 1) for i, p in enumerate(prompts)]
        concurrent = [f.result() for f in futures]
    assert concurrent == sequential
    # Continuous batching: far fewer steps than 6 requests x 8 tokens one at a time.
    assert served.async_engine.num_steps - steps_before < len(prompts) * 8
    served.wait_idle()


def test_seeded_sampling_is_reproducible_and_n_choices_differ(served):
    client = served.client()

    def run(n: int, seed: int) -> list[str]:
        resp = client.completions.create(
            model=served.model, prompt=PROMPT, max_tokens=8, n=n, seed=seed, temperature=1.0
        )
        return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]

    three = run(3, 1234)
    assert run(3, 1234) == three
    assert run(1, 1234) == three[:1]  # choice 0 uses the seed itself
    assert len(set(three)) > 1  # derived seeds: the choices are not copies
    assert run(1, 99) != three[:1]


def test_stop_string(served):
    client = served.client()
    full = client.completions.create(
        model=served.model,
        prompt=PROMPT,
        max_tokens=16,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"degenerate output {text!r}"
    cut = client.completions.create(
        model=served.model,
        prompt=PROMPT,
        max_tokens=16,
        stop=[stop],
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "stop"
    assert text.startswith(choice.text) and choice.text == text[: text.index(stop)]
    assert choice.model_extra.get("stop_reason") == stop


def test_completion_logprobs(served):
    resp = served.client().completions.create(
        model=served.model, prompt=PROMPT, max_tokens=5, logprobs=3, **greedy()
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert_tokens_spell(served, lp.tokens, resp.choices[0].text)
    assert lp.text_offset[0] == 0
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token_lp <= 0.0
        assert 1 <= len(top) <= 3
        # Greedy: the sampled token is the most likely one.
        assert max(top.values()) == pytest.approx(token_lp)
        assert top[token] == pytest.approx(token_lp)


# -- chat -------------------------------------------------------------------------------------


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


def test_chat_non_streaming_equals_streaming(served):
    client = served.client()
    tok = served.engine.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    resp = client.chat.completions.create(
        model=served.model,
        messages=MESSAGES,
        max_completion_tokens=10,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    [choice] = resp.choices
    assert resp.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == 10

    chunks = list(
        client.chat.completions.create(
            model=served.model,
            messages=MESSAGES,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **greedy(),
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_chat_logprobs_and_n(served):
    resp = served.client().chat.completions.create(
        model=served.model,
        messages=MESSAGES,
        max_tokens=4,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].message.content == resp.choices[1].message.content
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    assert_tokens_spell(served, [t.token for t in content], resp.choices[0].message.content)
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.bytes == list(t.token.encode())
    assert resp.usage.completion_tokens == 8


# -- prefix cache -----------------------------------------------------------------------------


def test_repeated_prompt_reports_cached_tokens(served):
    client = served.client()
    salt = f"test-{time.monotonic_ns()}"  # a fresh tenant: nothing cached for it yet

    def usage(cache_salt: str):
        return client.completions.create(
            model=served.model,
            prompt=LONG_PROMPT,
            max_tokens=2,
            extra_body={"cache_salt": cache_salt},
            **greedy(),
        ).usage

    hits_before = metric(served, "vllm:prefix_cache_hits_total")
    first = usage(salt)
    n = first.prompt_tokens
    assert n >= 32
    assert first.prompt_tokens_details.cached_tokens == 0
    assert first.model_extra["kvserve"] == {
        "cached_tokens_primary": 0,
        "cached_tokens_offload": 0,
        "computed_tokens": n,
    }
    second = usage(salt)
    cached = second.prompt_tokens_details.cached_tokens
    # Every full block of the prompt except a block holding the last token (always computed).
    assert cached == ((n - 1) // 16) * 16 > 0
    assert second.model_extra["kvserve"] == {
        "cached_tokens_primary": cached,
        "cached_tokens_offload": 0,
        "computed_tokens": n - cached,
    }
    # Another tenant does not see this tenant's cache.
    assert usage(salt + "-other").prompt_tokens_details.cached_tokens == 0
    assert metric(served, "vllm:prefix_cache_hits_total") >= hits_before + cached


# -- bad input --------------------------------------------------------------------------------


def _bad_completions(model: str) -> list[tuple[str, object, str | None]]:
    long_prompt = list(range(1, MAX_LEN + 5))
    return [
        ("invalid json", b'{"model": "x", "prompt": ', None),
        ("not an object", b"[1, 2, 3]", None),
        ("empty body", b"", None),
        (
            "wrong type max_tokens",
            {"model": model, "prompt": "hi", "max_tokens": "5"},
            "max_tokens",
        ),
        ("wrong type prompt", {"model": model, "prompt": {"a": 1}}, "prompt"),
        ("wrong type temperature", {"model": model, "prompt": "hi", "temperature": "hot"}, None),
        ("missing prompt", {"model": model}, "prompt"),
        ("empty prompt", {"model": model, "prompt": ""}, "prompt"),
        ("empty token list", {"model": model, "prompt": []}, "prompt"),
        ("empty prompt in batch", {"model": model, "prompt": ["hi", ""]}, "prompt"),
        ("prompt too long", {"model": model, "prompt": long_prompt}, "prompt"),
        (
            "prompt + max_tokens too long",
            {"model": model, "prompt": "hi", "max_tokens": 10**6},
            None,
        ),
        ("max_tokens 0", {"model": model, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("max_tokens negative", {"model": model, "prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ("n 0", {"model": model, "prompt": "hi", "n": 0}, "n"),
        ("absurd n", {"model": model, "prompt": "hi", "n": 10**9}, "n"),
        ("token id out of vocab", {"model": model, "prompt": [1, 10**9]}, None),
        ("negative temperature", {"model": model, "prompt": "hi", "temperature": -1}, None),
        ("top_p 0", {"model": model, "prompt": "hi", "top_p": 0}, None),
        ("logprobs too many", {"model": model, "prompt": "hi", "logprobs": 1000}, "logprobs"),
        ("seed out of range", {"model": model, "prompt": "hi", "seed": 2**70}, "seed"),
        ("empty stop string", {"model": model, "prompt": "hi", "stop": [""]}, None),
    ]


def _bad_chats(model: str) -> list[tuple[str, object, str | None]]:
    msgs = [{"role": "user", "content": "hi"}]
    base = {"model": model, "messages": msgs}
    return [
        ("no messages", {"model": model, "messages": []}, "messages"),
        ("bad role", {"model": model, "messages": [{"role": "wizard", "content": "x"}]}, None),
        ("max_completion_tokens 0", {**base, "max_completion_tokens": 0}, None),
        ("top_logprobs without logprobs", {**base, "top_logprobs": 2}, None),
        ("absurd n", {"model": model, "messages": msgs, "n": 100000}, "n"),
        ("wrong type messages", {"model": model, "messages": "hi"}, "messages"),
    ]  # fmt: skip


def _post(http: httpx.Client, path: str, body: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


def _assert_error(resp: httpx.Response, param: str | None, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_bad_input_is_400_and_server_stays_healthy(served):
    with served.http() as http:
        for _name, body, param in _bad_completions(served.model):
            _assert_error(_post(http, "/v1/completions", body), param)
        for _name, body, param in _bad_chats(served.model):
            _assert_error(_post(http, "/v1/chat/completions", body), param)
        # Unknown model: 404 as OpenAI and vLLM answer it.
        for path, body in [
            ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}),
            (
                "/v1/chat/completions",
                {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
            ),
        ]:
            err = _assert_error(_post(http, path, body), "model", 404)
            assert err["code"] == "model_not_found"
        assert http.get("/health").status_code == 200
    served.wait_idle()
    served.engine.check_integrity()
    # The official client surfaces them as BadRequestError; the server still serves.
    client = served.client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=served.model, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=served.model, messages=MESSAGES, n=10**6)
    ok = client.completions.create(model=served.model, prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_unknown_route_has_error_body(served):
    with served.http() as http:
        resp = http.get("/v1/nothing-here")
    assert resp.status_code == 404
    assert resp.json()["error"]["message"]


# -- disconnects ------------------------------------------------------------------------------


def test_streaming_client_disconnect_aborts_and_frees_blocks(served):
    served.wait_idle()
    aborts_before = metric(served, "vllm:request_success_total", 'finished_reason="abort",')
    client = served.client()
    stream = client.completions.create(
        model=served.model,
        prompt=LONG_PROMPT,
        max_tokens=150,
        stream=True,
        extra_body={"ignore_eos": True},
        **greedy(),
    )
    received = []
    for chunk in stream:
        received.append(chunk)
        if len(received) == 3:
            break
    stats = served.async_engine.stats()
    deadline = time.monotonic() + 5
    while stats.num_running != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = served.async_engine.stats()
    assert stats.num_running == 1 and stats.kv_cache_usage > 0
    stream.close()  # the client goes away mid-stream
    served.wait_idle()
    served.engine.check_integrity()
    assert metric(served, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(served, "vllm:num_requests_running") == 0.0
    assert (
        metric(served, "vllm:request_success_total", 'finished_reason="abort",')
        == aborts_before + 1
    )


def test_non_streaming_client_disconnect_aborts(served):
    served.wait_idle()
    body = {
        "model": served.model,
        "prompt": PROMPT,
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0,
    }
    runner = served.engine.runner
    real_execute = runner.execute_model
    slow = threading.Event()

    def slow_execute(scheduler_output):  # 200 steps take >= 2 s, whatever the machine
        slow.wait(0.01)
        return real_execute(scheduler_output)

    runner.execute_model = slow_execute
    try:
        with (
            httpx.Client(base_url=served.base_url, timeout=0.5) as http,
            pytest.raises(httpx.ReadTimeout),
        ):
            http.post("/v1/completions", json=body)  # gives up (closes) before the answer
        served.wait_idle()
    finally:
        runner.execute_model = real_execute
    served.engine.check_integrity()


# -- metadata endpoints -----------------------------------------------------------------------


def test_models_health_openapi(served):
    models = served.client().models.list()
    [card] = models.data
    assert card.id == served.model
    assert card.model_extra["max_model_len"] == MAX_LEN
    with served.http() as http:
        assert http.get("/health").status_code == 200
        spec = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(
        spec["paths"]
    )
    assert "CompletionRequest" in spec["components"]["schemas"]


def test_metrics_exposition(served):
    client = served.client()
    client.completions.create(model=served.model, prompt=PROMPT, max_tokens=3, **greedy())
    with served.http() as http:
        resp = http.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    values = parse_metrics(resp.text)
    names = {key.split("{")[0] for key in values}
    expected = {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
    }
    assert expected <= names, expected - names
    label = f'{{model_name="{served.model}"}}'
    assert values["vllm:generation_tokens_total" + label] >= 3
    assert values["vllm:prompt_tokens_total" + label] >= len(served.engine.tokenizer.encode(PROMPT))
    assert values["vllm:time_to_first_token_seconds_count" + label] >= 1
    assert (
        values["vllm:prefix_cache_queries_total" + label]
        >= values["vllm:prefix_cache_hits_total" + label]
    )
    # No connector configured: no offload metrics.
    assert not any(n.startswith("vllm:kv_offload") for n in names)


# -- engine failure ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_is_an_error_then_unhealthy(server_factory, stream: bool):
    served = server_factory()
    runner = served.engine.runner
    real_execute = runner.execute_model
    calls = 0

    def failing_execute(scheduler_output):  # fault injection: the 4th forward pass fails
        nonlocal calls
        calls += 1
        if calls >= 4:
            raise RuntimeError("device lost")
        return real_execute(scheduler_output)

    runner.execute_model = failing_execute
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 50, "ignore_eos": True}
    with served.http() as http:
        assert http.get("/health").status_code == 200
        if stream:  # the request in flight gets an error event, then [DONE]
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                assert resp.status_code == 200
                events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
        else:  # the request in flight gets a 500 with an error body
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 500
            error = resp.json()["error"]
        assert "device lost" in error["message"] and error["type"] == "server_error"
        health = http.get("/health")
        assert health.status_code == 503 and "device lost" in health.json()["error"]["message"]
        # Later requests fail fast with an error body instead of hanging.
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 503 and resp.json()["error"]["message"]
