"""EngineCoreClient: an :class:`LLMEngine` in its own process, streamed to asyncio.

Owns the API-server side of the engine-core process (:mod:`kvserve.engine.core_process`):
starting it (``python -m kvserve.engine.core_process``, the config as JSON on stdin), the two
ZMQ sockets to it (commands in, outputs out, over ``ipc://`` in a private directory), the
receiver thread that turns the core's per-step deltas into cumulative
:class:`RequestOutput` s and hands them to each request's event loop, the latest stats
snapshot, and the core's death (every outstanding request fails with
:class:`EngineDeadError`, ``is_alive`` turns false). Same interface as :class:`AsyncEngine`,
which runs the engine on a thread of this process instead.

Why a process: on a thread the engine's Python between torch ops shares the GIL with the HTTP
server, tokenizers and output streams, so every step waits for the event loop's work; in its
own process a step waits for nothing (vLLM v1's API server / ``EngineCore`` split).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import msgspec
import zmq

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    StreamingEngine,
    _call,
    _deliver,
    _fail_stream,
    _resolve,
    _Stream,
)
from kvserve.engine.core_messages import (
    AbortRequests,
    Accepted,
    AddRequest,
    CoreOutput,
    Failed,
    Ready,
    Shutdown,
    StatsUpdate,
    StepOutputs,
    client_decoder,
    client_encoder,
)
from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The receiver thread checks this often that the core still lives (seconds).
_LIVENESS_POLL_S = 0.1


class _OutputState:
    """A request's cumulative output, rebuilt from the core's deltas."""

    __slots__ = ("prompt", "prompt_token_ids", "token_ids", "text", "logprobs")

    def __init__(self, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, float]] = []

    def apply(self, o: CoreOutput) -> RequestOutput:
        self.token_ids.extend(o.new_token_ids)
        self.text += o.new_text
        if o.prompt_token_ids is not None:
            self.prompt_token_ids = o.prompt_token_ids
        logprobs = None
        if o.new_logprobs is not None:
            self.logprobs.extend(o.new_logprobs)
            logprobs = list(self.logprobs)
        return RequestOutput(
            request_id=o.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=self.text,
                    token_ids=list(self.token_ids),
                    cumulative_logprob=o.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                )
            ],
            finished=o.finished,
            metrics=RequestMetrics(*o.metrics),
            new_token_ids=o.new_token_ids,
            new_text=o.new_text,
            kv_transfer_params=o.kv_transfer_params,
        )


class _ExpertLoad:
    """What :mod:`kvserve.server.moe_metrics` reads: the core's latest expert counts."""

    def __init__(self, client: EngineCoreClient) -> None:
        self._client = client

    def expert_load(self) -> dict[int, list[int]]:
        return self._client._expert_load or {}


class EngineCoreClient(StreamingEngine):
    """Asyncio facade of an engine-core process (the interface of :class:`AsyncEngine`).

    The constructor starts the process and returns once its engine is built (raising
    ``RuntimeError`` with the core's error when it could not be)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        startup_timeout: float = 1800.0,
        log_level: str = "WARNING",
    ) -> None:
        from kvserve.engine.engine import EngineStats

        self.config = config
        self.tokenizer = Tokenizer(config.tokenizer or config.model)
        self.error: BaseException | None = None
        self._lock = threading.Lock()  # the streams, the states and the command socket
        self._streams: dict[str, _Stream] = {}
        self._states: dict[str, _OutputState] = {}
        self._closing = False
        self._num_steps = 0
        self._expert_load: dict[int, list[int]] | None = None
        self._dir = tempfile.mkdtemp(prefix="kvserve-core-")
        self._ctx = zmq.Context()
        self._cmd = self._ctx.socket(zmq.PUSH)
        self._cmd.setsockopt(zmq.SNDHWM, 0)
        self._cmd.setsockopt(zmq.LINGER, 0)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        cmd_addr = f"ipc://{self._dir}/cmd"
        out_addr = f"ipc://{self._dir}/out"
        self._cmd.bind(cmd_addr)
        self._out.bind(out_addr)
        argv = [
            sys.executable,
            "-m",
            "kvserve.engine.core_process",
            cmd_addr,
            out_addr,
            str(os.getpid()),
            log_level,
        ]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(msgspec.json.encode(config))
            self._proc.stdin.close()
            ready = self._wait_ready(startup_timeout)
        except BaseException:
            self._stop_process(0.0)
            self._close_sockets()
            raise
        self.info = ready
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.has_connector = ready.has_connector
        self._stats: Any = EngineStats(num_kv_blocks=ready.num_kv_blocks)
        self._receiver = threading.Thread(
            target=self._receive, name="kvserve-core-client", daemon=True
        )
        self._receiver.start()

    # -- lifecycle ------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while True:
            if self._out.poll(int(_LIVENESS_POLL_S * 1000)):
                msg = client_decoder.decode(self._out.recv())
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, Failed):
                    raise RuntimeError(f"engine core failed to start: {msg.error}")
                continue
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(f"engine core process exited with code {code} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine core not ready after {timeout:.0f} s")

    def start(self) -> None:
        """Nothing to do: the core runs from construction on (kept for AsyncEngine's API)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (after its current step), fail outstanding requests, free the IPC."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            if self._proc.poll() is None:
                with contextlib.suppress(EngineDeadError):
                    self._send(client_encoder.encode(Shutdown()))
        self._stop_process(timeout)
        if self._receiver is not threading.current_thread():
            self._receiver.join(timeout)
        self._fail_all(EngineDeadError("engine shut down"))
        self._close_sockets()

    def _stop_process(self, timeout: float) -> None:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.terminate()
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def _close_sockets(self) -> None:
        self._cmd.close(0)
        self._out.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pid(self) -> int:
        """The engine-core process's pid."""
        return self._proc.pid

    @property
    def is_alive(self) -> bool:
        """True while the core process runs and has not failed."""
        return self.error is None and not self._closing and self._proc.poll() is None

    @property
    def num_steps(self) -> int:
        """Steps the core had taken at its latest output."""
        return self._num_steps

    def stats(self) -> Any:
        """The core's latest ``EngineStats`` snapshot (at most ~50 ms old while busy)."""
        return self._stats

    @property
    def expert_load_source(self) -> _ExpertLoad | None:
        """An object with ``expert_load()`` for MoE models' metrics, else None."""
        return _ExpertLoad(self) if self.info.has_expert_load else None

    @property
    def num_inflight(self) -> int:
        """Requests added through this client that have not finished or been aborted."""
        return len(self._streams)

    # -- requests -------------------------------------------------------------------------
    def _submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None,
        kv_transfer_params: dict[str, Any] | None,
    ) -> None:
        text = prompt if isinstance(prompt, str) else None
        prompt_ids = [] if text is not None else list(prompt)
        self._send(
            client_encoder.encode(
                AddRequest(request_id, prompt, params, cache_salt, kv_transfer_params)
            )
        )
        self._states[request_id] = _OutputState(text, prompt_ids)

    def _abort_nowait(self, request_ids: list[str]) -> None:
        with self._lock:
            if self.error is None and not self._closing:
                with contextlib.suppress(EngineDeadError):  # a dead core ends every stream
                    self._send(client_encoder.encode(AbortRequests(list(request_ids))))

    def _send(self, msg: bytes) -> None:
        # Never blocking: the queue is unbounded, so the only refusal is a core that is gone
        # (a PUSH socket without a peer would block the event loop forever).
        try:
            self._cmd.send(msg, zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError("engine core process is not reachable") from None

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine core failed: {self.error}") from self.error
        if self._closing:
            raise EngineDeadError("engine is shut down")
        if self._proc.poll() is not None:
            raise EngineDeadError(f"engine core process exited with code {self._proc.returncode}")

    # -- receiver thread ------------------------------------------------------------------
    def _receive(self) -> None:
        sock = self._out
        try:
            while not self._closing:
                if not sock.poll(int(_LIVENESS_POLL_S * 1000)):
                    code = self._proc.poll()
                    if code is not None and not self._closing:
                        self._die(f"engine core process exited with code {code}")
                        return
                    continue
                msgs = []
                while True:
                    try:
                        msgs.append(client_decoder.decode(sock.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                self._handle(msgs)
        except zmq.ContextTerminated:
            return
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the requests
            if not self._closing:
                logger.exception("engine core client failed")
                self._die(f"engine core client failed: {exc!r}")

    def _handle(self, msgs: list[Any]) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        resolutions: list[tuple[asyncio.AbstractEventLoop, asyncio.Future, Any]] = []
        with self._lock:
            for msg in msgs:
                if isinstance(msg, StepOutputs):
                    self._num_steps = msg.num_steps
                    for o in msg.outputs:
                        rid = o.request_id
                        stream = self._streams.get(rid)
                        state = self._states.get(rid)
                        if stream is None or state is None:
                            continue
                        if o.finished:
                            del self._streams[rid]
                            del self._states[rid]
                        out = state.apply(o)
                        per_loop.setdefault(stream.loop, []).append((stream.queue, out))
                elif isinstance(msg, Accepted):
                    stream = self._streams.get(msg.request_id)
                    if stream is None:
                        continue
                    if msg.error is None:
                        resolutions.append((stream.loop, stream.accepted, None))
                    else:
                        del self._streams[msg.request_id]
                        self._states.pop(msg.request_id, None)
                        resolutions.append((stream.loop, stream.accepted, ValueError(msg.error)))
                elif isinstance(msg, StatsUpdate):
                    from kvserve.engine.engine import EngineStats

                    self._stats = msgspec.convert(msg.stats, EngineStats)
                    if msg.expert_load is not None:
                        self._expert_load = msg.expert_load
        for loop, fut, exc in resolutions:
            _call(loop, _resolve, fut, exc)
        for loop, items in per_loop.items():
            _call(loop, _deliver, items)

    def _die(self, reason: str) -> None:
        logger.error("%s", reason)
        self.error = EngineDeadError(reason)
        self._fail_all(EngineDeadError(reason))

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            self._states = {}
        for stream in streams:
            _call(stream.loop, _fail_stream, stream, exc)


# What the server is given: the engine on a thread of its process, or in a process of its own.
EngineClient = AsyncEngine | EngineCoreClient
