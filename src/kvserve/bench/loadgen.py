"""An async load generator for OpenAI-compatible servers (kvserve, vLLM, SGLang, a router).

Each request is a streaming ``/v1/completions`` or ``/v1/chat/completions`` call, timed the
way vLLM's ``benchmark_serving`` times it: TTFT from just before the POST to the first chunk
carrying a token, one inter-token latency per later token chunk, E2E to the last token chunk.
Output lengths are fixed with ``ignore_eos`` + ``max_tokens`` (optionally ``min_tokens``);
``stream_options.include_usage`` asks for the final usage chunk, whose
``prompt_tokens_details.cached_tokens`` gives the prefix-cache hit of each request.

Two ways to offer load:

- open loop: sessions start at Poisson (or gamma, or the trace's own) arrival times,
  optionally with at most ``max_concurrency`` requests in flight;
- closed loop: ``concurrency`` users, each running one session after another.

A session's turns are sent one after another (think time between them), each built from the
history with the previous answer fed back. ``duration`` bounds the run: nothing is sent after
it and requests still in flight are cancelled (recorded as errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvserve.bench.arrivals import arrival_times
from kvserve.bench.records import RequestRecord
from kvserve.bench.trace import TraceEntry
from kvserve.bench.workloads import Api, Conversation, Session, TurnRequest, Workload
from kvserve.cluster.headers import DESTINATION_HEADER, ENDPOINT_HEADER

CANCELLED = "cancelled: benchmark time limit"
DEFAULT_ENDPOINT_HEADERS = (ENDPOINT_HEADER, DESTINATION_HEADER)


@dataclass
class LoadConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str
    api: Api = "completions"
    request_rate: float = math.inf  # open loop: sessions started per second
    burstiness: float = 1.0  # gamma shape of the gaps (1: Poisson)
    concurrency: int | None = None  # closed loop: this many sessions at once
    max_concurrency: int | None = None  # open loop: cap on requests in flight
    duration: float | None = None  # seconds; stop sending and cancel after it
    use_arrival_times: bool = True  # sessions with their own arrival_time (traces) keep it
    temperature: float = 0.0
    ignore_eos: bool = True
    min_tokens: bool = False  # also send min_tokens = max_tokens
    include_usage: bool = True
    # Ask for the generated token ids (vLLM's ``return_token_ids``); when a server streams
    # ``token_ids`` per choice, multi-turn token-id workloads feed back the exact ids.
    return_token_ids: bool = False
    timeout: float = 1800.0  # per request
    seed: int = 0
    endpoint_headers: tuple[str, ...] = DEFAULT_ENDPOINT_HEADERS
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)
    record_trace: bool = False  # keep every prompt sent (to write a replayable trace)
    progress: bool = True
    label: str = ""

    @property
    def api_base(self) -> str:
        base = self.base_url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration: float  # start of the run to the end of its last request
    sent_trace: list[TraceEntry] = field(default_factory=list)
    unsent_sessions: int = 0  # sessions not started before the time limit


def request_body(cfg: LoadConfig, req: TurnRequest) -> dict:
    body: dict = {"model": cfg.model, "max_tokens": req.output_len, "stream": True}
    if cfg.api == "chat":
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    body["temperature"] = cfg.temperature
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.min_tokens:
        body["min_tokens"] = req.output_len
    if cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    body.update(cfg.extra_body)
    return body


def _error_text(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw)
        msg = err.get("error", err) if isinstance(err, dict) else err
        if isinstance(msg, dict):
            msg = msg.get("message", msg)
    except ValueError:
        msg = raw.decode(errors="replace")
    return f"HTTP {status}: {str(msg)[:300]}"


def _token_text(api: Api, choice: dict) -> tuple[bool, str]:
    """Whether a streamed choice carries a generated token, and its text.

    A token may decode to no text yet (an incomplete UTF-8 sequence held back), so an empty
    chunk still counts unless it only closes the stream (finish_reason set) or only
    announces the chat role.
    """
    finished = choice.get("finish_reason") is not None
    if api == "chat":
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text:
            return True, text
        return (text is not None and "role" not in delta and not finished), ""
    text = choice.get("text")
    if text:
        return True, text
    return ("text" in choice and not finished), ""


def new_record(req: TurnRequest, request_id: str) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        session_id=req.session_id,
        turn=req.turn,
        group=req.group,
        output_len=req.output_len,
        prompt_tokens=req.num_prompt_tokens,
    )


async def send_request(
    client: httpx.AsyncClient,
    cfg: LoadConfig,
    req: TurnRequest,
    rec: RequestRecord,
    t0: float,
) -> RequestRecord:
    """Send one streaming request, measuring it into ``rec`` (also returned). Never raises
    except on cancellation, after which ``rec`` says so and holds what was measured."""
    url = cfg.api_base + ("/chat/completions" if cfg.api == "chat" else "/completions")
    body = request_body(cfg, req)
    parts: list[str] = []
    ids: list[int] = []
    events = 0
    usage_tokens: int | None = None
    last: float | None = None
    st = time.perf_counter()
    rec.start_time = st - t0
    try:
        async with client.stream("POST", url, json=body, headers=cfg.headers) as resp:
            for h in cfg.endpoint_headers:
                if h in resp.headers:
                    rec.endpoint = resp.headers[h]
                    break
            if resp.status_code != 200:
                rec.error = _error_text(resp.status_code, await resp.aread())
                return rec
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if "error" in chunk:
                    err = chunk["error"]
                    rec.error = (
                        f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    )
                    break
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = details["cached_tokens"]
                for choice in chunk.get("choices") or []:
                    if choice.get("index", 0) != 0:
                        continue
                    ids.extend(choice.get("token_ids") or ())
                    is_token, text = _token_text(cfg.api, choice)
                    if not is_token:
                        continue
                    if last is None:
                        rec.ttft = now - st
                    else:
                        rec.itl.append(now - last)
                    last = now
                    events += 1
                    parts.append(text)
            if not done and rec.error is None:
                rec.error = "stream ended without [DONE]"
    except asyncio.CancelledError:
        rec.error = CANCELLED
        _finish(rec, st, last, events, usage_tokens, parts, ids)
        raise
    except (httpx.HTTPError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}".strip()
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        rec.error = f"bad response: {type(e).__name__}: {e}"
    _finish(rec, st, last, events, usage_tokens, parts, ids)
    return rec


def _finish(rec, st, last, events, usage_tokens, parts, ids) -> None:
    rec.e2e = None if last is None else last - st
    rec.output_tokens = usage_tokens if usage_tokens is not None else events
    rec.output_text = "".join(parts)
    rec.output_token_ids = ids or None


class _Progress:
    """A rich progress bar of requests done (with the error count), or nothing."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.enabled = enabled
        self.errors = 0
        self.label = label or "requests"
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._p = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("errors: {task.fields[errors]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            self._task = self._p.add_task(self.label, total=total, errors=0)

    def __enter__(self) -> _Progress:
        if self.enabled:
            self._p.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._p.stop()

    def advance(self, rec: RequestRecord) -> None:
        self.errors += rec.error is not None
        if self.enabled:
            self._p.update(self._task, advance=1, errors=self.errors)


def _client(cfg: LoadConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.timeout, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


async def run_load_async(
    workload: Workload,
    cfg: LoadConfig,
    *,
    tokenize: Callable[[str], list[int]] | None = None,
    warmup: Workload | None = None,
) -> LoadResult:
    """Offer ``workload`` to the server and measure every request."""
    if cfg.concurrency is not None and cfg.concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if workload.kind == "tokens" and cfg.api == "chat":
        raise ValueError("the chat API needs a text workload")
    if cfg.record_trace and cfg.api == "chat":
        raise ValueError("traces hold completions prompts: record them with api='completions'")
    async with _client(cfg) as client:
        if warmup is not None and warmup.sessions:
            wcfg = LoadConfig(**{**cfg.__dict__, "progress": False, "record_trace": False})
            await _drive(client, warmup, wcfg, tokenize, len(warmup.sessions), "warmup")
        return await _drive(client, workload, cfg, tokenize, cfg.concurrency, "r")


async def _drive(
    client: httpx.AsyncClient,
    workload: Workload,
    cfg: LoadConfig,
    tokenize: Callable[[str], list[int]] | None,
    concurrency: int | None,
    id_prefix: str,
) -> LoadResult:
    records: list[RequestRecord] = []
    sent: list[TraceEntry] = []
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    counter = iter(range(1 << 62))
    started = 0
    t0 = time.perf_counter()
    deadline = None if cfg.duration is None else t0 + cfg.duration

    async def run_session(session: Session, progress: _Progress) -> None:
        conv = Conversation(session, cfg.api, tokenize=tokenize)
        while not conv.done:
            req = conv.next_request()
            if req.turn > 0 and req.think_time > 0:
                await asyncio.sleep(req.think_time)
            if deadline is not None and time.perf_counter() >= deadline:
                return
            rid = f"{id_prefix}{next(counter)}-{session.session_id}-{req.turn}"
            if cfg.record_trace:
                assert req.prompt is not None
                sent.append(
                    TraceEntry(
                        time.perf_counter() - t0,
                        req.prompt,
                        req.output_len,
                        session.session_id,
                        session.group,
                    )
                )
            rec = new_record(req, rid)
            records.append(rec)
            if sem is not None:
                async with sem:
                    await send_request(client, cfg, req, rec, t0)
            else:
                await send_request(client, cfg, req, rec, t0)
            progress.advance(rec)
            if rec.error is not None:
                return  # the history is lost: end the session
            conv.record_answer(rec.output_text, rec.output_token_ids)
            rec.output_text, rec.output_token_ids = "", None

    sessions = workload.sessions
    with _Progress(cfg.progress, workload.num_requests, cfg.label) as progress:
        if concurrency is not None:
            it = iter(sessions)

            async def user() -> None:
                nonlocal started
                for s in it:
                    if deadline is not None and time.perf_counter() >= deadline:
                        return
                    started += 1
                    await run_session(s, progress)

            tasks = [asyncio.create_task(user()) for _ in range(concurrency)]
        else:
            own = cfg.use_arrival_times and all(s.arrival_time is not None for s in sessions)
            if own:
                times = [float(s.arrival_time) for s in sessions]  # type: ignore[arg-type]
            else:
                times = arrival_times(
                    len(sessions), cfg.request_rate, burstiness=cfg.burstiness, seed=cfg.seed
                )

            async def start_at(t: float, s: Session) -> None:
                nonlocal started
                delay = t0 + t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                started += 1
                await run_session(s, progress)

            pairs = zip(times, sessions, strict=True)
            tasks = [asyncio.create_task(start_at(t, s)) for t, s in pairs]
        timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*pending, return_exceptions=True)
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # a bug in the driver, not a request failure
    end = max([t0] + [t0 + r.finish_time for r in records if r.finish_time is not None])
    if deadline is not None:
        end = max(end, min(time.perf_counter(), deadline))
    records.sort(key=lambda r: r.start_time)
    for r in records:
        r.output_text, r.output_token_ids = "", None  # only needed for the next turn
    return LoadResult(records, end - t0, sent, len(sessions) - started)


def run_load(
    workload: Workload,
    cfg: LoadConfig,
    *,
    tokenize: Callable[[str], list[int]] | None = None,
    warmup: Workload | None = None,
) -> LoadResult:
    """Synchronous wrapper of :func:`run_load_async`."""
    return asyncio.run(run_load_async(workload, cfg, tokenize=tokenize, warmup=warmup))


# ---------------------------------------------------------------------------------------------
# Server helpers


def wait_for_server(base_url: str, timeout: float = 120.0, proc=None) -> None:
    """Poll ``/health`` (then ``/v1/models``) until the server answers 200."""
    base = base_url.rstrip("/").removesuffix("/v1")
    end = time.monotonic() + timeout
    last_err: Exception | str | None = None
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < end:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server process exited with code {proc.returncode}")
            for path in ("/health", "/v1/models"):
                try:
                    r = client.get(base + path)
                    if r.status_code == 200:
                        return
                    last_err = f"{path}: HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    last_err = e
            time.sleep(0.5)
    raise TimeoutError(f"server at {base_url} not ready after {timeout:.0f}s ({last_err})")


def discover_model(base_url: str) -> str:
    """The first model id the server lists at ``/v1/models``."""
    base = base_url.rstrip("/").removesuffix("/v1")
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        r = client.get(base + "/v1/models")
        r.raise_for_status()
        data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url} lists no models")
    return data[0]["id"]


def http_run(
    workload: Workload,
    cfg: LoadConfig,
    *,
    tokenize: Callable[[str], list[int]] | None = None,
    warmup: Workload | None = None,
):
    """Run the load and summarize it: ``(LoadResult, report.Run)`` labelled ``cfg.label``."""
    from kvserve.bench.report import Run, summarize

    result = run_load(workload, cfg, tokenize=tokenize, warmup=warmup)
    summary = summarize(result.records, result.duration, cfg.label)
    conf = dict(
        target=cfg.base_url,
        model=cfg.model,
        api=cfg.api,
        request_rate=cfg.request_rate,
        burstiness=cfg.burstiness,
        concurrency=cfg.concurrency,
        max_concurrency=cfg.max_concurrency,
        duration_limit=cfg.duration,
        temperature=cfg.temperature,
        ignore_eos=cfg.ignore_eos,
        unsent_sessions=result.unsent_sessions,
    )
    return result, Run(summary, result.records, conf)
