"""AsyncEngine: runs one :class:`LLMEngine` on a dedicated thread and streams to asyncio.

Owns the engine thread and the hand-off between it and any number of event loops. The engine
is touched only by its thread: adds and aborts are queued and applied between steps, outputs
are routed to per-request ``asyncio.Queue`` s with ``loop.call_soon_threadsafe``. The thread
sleeps on a condition when there is no work. An exception in the loop fails every outstanding
request with :class:`EngineDeadError` (and :attr:`AsyncEngine.is_alive` turns false) instead
of leaving them hanging. It must not contain scheduling or model logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

# Minimum age of the cached stats snapshot before the engine thread refreshes it while busy.
_STATS_REFRESH_S = 0.05

StepListener = Callable[[list[RequestOutput]], None]


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crashed or shut down); the request cannot complete."""


@dataclasses.dataclass(eq=False)
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput | BaseException items
    accepted: asyncio.Future  # None once added to the engine, or the add_request exception


class RequestStream:
    """Outputs of one request, in order. Iterating ends after the finished output.

    Consecutive outputs that queued up while the consumer was busy are merged into one
    (the latest cumulative state, with ``new_token_ids``/``new_text`` concatenated).
    Leaving the iteration early (``aclose()``, cancellation) aborts the request.
    """

    def __init__(self, engine: StreamingEngine, stream: _Stream) -> None:
        self._engine = engine
        self._stream = stream
        self.finished = False

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        queue = self._stream.queue
        try:
            item = await queue.get()
        except BaseException:
            self.abort()
            raise
        items = [item]
        while not queue.empty() and not isinstance(items[-1], BaseException):
            items.append(queue.get_nowait())
        if isinstance(items[-1], BaseException):
            error = items.pop()
            if not items:
                self.finished = True
                raise error
            queue.put_nowait(error)  # the outputs that came before it are seen first
        out = items[-1] if len(items) == 1 else _merge(items)
        if out.finished:
            self.finished = True
        return out

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent, non-blocking)."""
        if not self.finished:
            self.finished = True
            self._engine._abort_nowait([self.request_id])

    async def aclose(self) -> None:
        self.abort()


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    last = outputs[-1]
    return dataclasses.replace(
        last,
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outputs),
    )


class StreamingEngine:
    """What both engine facades share (:class:`AsyncEngine` here, the engine-core client in
    :mod:`kvserve.engine.core_client`): adding a request and waiting for its acceptance,
    ``generate`` and aborts by id. Subclasses hold ``_streams`` (live requests by id) under
    ``_lock`` and implement ``_check_alive``, ``_submit`` and ``_abort_nowait``."""

    _lock: Any  # a lock or condition guarding ``_streams`` and the submission order
    _streams: dict[str, _Stream]

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it.

        Raises the engine's ``ValueError`` for bad input, :class:`EngineDeadError` when the
        engine is not running, ``KeyError`` for a duplicate live request id.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        stream = _Stream(request_id, loop, asyncio.Queue(), loop.create_future())
        with self._lock:
            self._check_alive()  # again under the lock: a failing engine takes the streams
            if request_id in self._streams:
                raise KeyError(f"request id {request_id!r} is already running")
            self._submit(request_id, prompt, params, cache_salt, kv_transfer_params)
            self._streams[request_id] = stream
        return await self._accepted(stream)

    def _check_alive(self) -> None:
        """Raise :class:`EngineDeadError` unless the engine takes requests."""
        raise NotImplementedError

    def _submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None,
        kv_transfer_params: dict[str, Any] | None,
    ) -> None:
        """Hand a new request to the engine (under ``_lock``; its stream is registered
        right after)."""
        raise NotImplementedError

    def _abort_nowait(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def _accepted(self, stream: _Stream) -> RequestStream:
        """The handle of a queued request once the engine accepted it (its error if not)."""
        handle = RequestStream(self, stream)
        try:
            await stream.accepted
        except asyncio.CancelledError:
            handle.abort()
            raise
        except BaseException:
            handle.finished = True
            raise
        return handle

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; leaving early aborts it."""
        stream = await self.add_request(
            request_id, prompt, params, cache_salt=cache_salt, kv_transfer_params=kv_transfer_params
        )
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its stream ends with an abort."""
        self._abort_nowait([request_id])


class AsyncEngine(StreamingEngine):
    """Thread-backed asyncio facade of an :class:`LLMEngine`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # Called in the engine thread after every loop iteration that did work, with the
        # outputs of the step (empty when only adds/aborts were applied). Must be quick.
        self.step_listeners: list[StepListener] = []
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: list[tuple[str, Any]] = []
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._stats: Any = None
        self._stats_time = 0.0
        self._num_steps = 0

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._stats = self.engine.get_stats()
        self._stats_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread, fail outstanding requests, and shut the engine down."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fail_all(EngineDeadError("engine shut down"))
        self.engine.shutdown()

    @property
    def is_alive(self) -> bool:
        """True while the engine loop runs and has not failed."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self.error is None
            and not self._stop
        )

    @property
    def num_steps(self) -> int:
        return self._num_steps

    # What the server reads of the engine (the engine-core client has the same attributes).
    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def has_connector(self) -> bool:
        return getattr(self.engine, "connector", None) is not None

    @property
    def expert_load_source(self) -> Any:
        """The model when it counts tokens per expert (MoE metrics), else None."""
        model = getattr(getattr(self.engine, "runner", None), "model", None)
        return model if hasattr(model, "expert_load") else None

    def stats(self) -> Any:
        """The latest ``engine.get_stats()`` snapshot, taken in the engine thread."""
        return self._stats

    @property
    def num_inflight(self) -> int:
        """Requests added through this facade that have not finished or been aborted."""
        return len(self._streams)

    # -- requests -------------------------------------------------------------------------
    @property
    def _lock(self) -> threading.Condition:
        return self._cond

    def _submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None,
        kv_transfer_params: dict[str, Any] | None,
    ) -> None:
        self._commands.append(("add", (request_id, prompt, params, cache_salt, kv_transfer_params)))
        self._cond.notify()

    def _abort_nowait(self, request_ids: list[str]) -> None:
        with self._cond:
            self._commands.append(("abort", list(request_ids)))
            self._cond.notify()

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine loop failed: {self.error!r}") from self.error
        if self._thread is None:
            raise EngineDeadError("engine not started")
        if self._stop or not self._thread.is_alive():
            raise EngineDeadError("engine is shut down")

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stop or engine.has_unfinished_requests()):
                        self._refresh_stats(force=True)
                        self._cond.wait()
                    if self._stop:
                        return
                    commands, self._commands = self._commands, []
                self._apply(commands)
                outputs: list[RequestOutput] = []
                if engine.has_unfinished_requests():
                    # A step with nothing to compute sleeps inside the engine (on the KV
                    # transfers it waits for), so re-stepping at once never spins.
                    outputs = engine.step()
                    self._num_steps += 1
                    if outputs:
                        self._dispatch(outputs)
                for listener in self.step_listeners:
                    try:
                        listener(outputs)
                    except Exception:
                        logger.exception("step listener %r failed", listener)
                self._refresh_stats()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the requests
            logger.exception("engine loop failed")
            self.error = exc
            self._fail_all(EngineDeadError(f"engine loop failed: {exc!r}"))

    def _apply(self, commands: list[tuple[str, Any]]) -> None:
        for kind, payload in commands:
            if kind == "add":
                request_id, prompt, params, cache_salt, kv_transfer_params = payload
                stream = self._streams.get(request_id)
                if stream is None:  # aborted before it was added
                    continue
                try:
                    self.engine.add_request(
                        request_id,
                        prompt,
                        params,
                        cache_salt=cache_salt,
                        kv_transfer_params=kv_transfer_params,
                    )
                except Exception as exc:
                    with self._cond:
                        self._streams.pop(request_id, None)
                    _call(stream.loop, _resolve, stream.accepted, exc)
                else:
                    _call(stream.loop, _resolve, stream.accepted, None)
            else:
                with self._cond:
                    doomed = {rid: self._streams[rid] for rid in payload if rid in self._streams}
                if not doomed:
                    continue
                # Each stream ends with its request's final output; once a consumer has seen
                # it, the id may be taken again at once: only the aborted streams go.
                self._dispatch(self.engine.abort_request(list(doomed)))
                with self._cond:
                    for rid, stream in doomed.items():
                        if self._streams.get(rid) is stream:
                            del self._streams[rid]

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._cond:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:  # aborted meanwhile, or not added through this facade
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                per_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in per_loop.items():
            _call(loop, _deliver, items)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            streams, self._streams = list(self._streams.values()), {}
            self._commands = []
        for stream in streams:
            _call(stream.loop, _fail_stream, stream, exc)

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= _STATS_REFRESH_S:
            self._stats = self.engine.get_stats()
            self._stats_time = now


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    # RuntimeError: the consumer's loop is closed, nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _fail_stream(stream: _Stream, exc: BaseException) -> None:
    if not stream.accepted.done():
        stream.accepted.set_exception(exc)
    stream.queue.put_nowait(exc)
