"""The engine-core process: one :class:`LLMEngine` stepping in a process of its own.

Owns the child side of :class:`kvserve.engine.core_client.EngineCoreClient`: build the engine,
say :class:`Ready` (or :class:`Failed`), then loop: apply the client's commands, step, send the
step's outputs as deltas, publish KV events, and send a stats snapshot at most every
``STATS_INTERVAL_S`` while busy and whenever it goes idle. Idle, it blocks on its input
socket. It has no other thread holding the GIL between its steps (the HTTP server, the
tokenizers and the output streams live in the API server process), which is the point: a
step never waits for the event loop, as in vLLM v1's ``EngineCore`` process.

The process dies with its parent (``PR_SET_PDEATHSIG``, and a parent-pid check while idle),
ignores SIGINT (the API server shuts it down after draining) and exits on :class:`Shutdown`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from typing import Any

from kvserve.config import EngineConfig
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
    core_decoder,
    core_encoder,
)

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05
# Idle: how often the loop wakes to check that its parent still lives (milliseconds).
IDLE_POLL_MS = 500
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main() -> None:
    """``python -m kvserve.engine.core_process INPUT OUTPUT PARENT_PID LOG_LEVEL``, the
    :class:`EngineConfig` as JSON on stdin (its KV event topic already resolved)."""
    import msgspec

    input_addr, output_addr, parent_pid, log_level = sys.argv[1:5]
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    run_engine_core(config, input_addr, output_addr, int(parent_pid), log_level)


def run_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int, log_level: str
) -> None:
    import zmq

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper())
    if os.getppid() != parent_pid:
        return
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(output_addr)
    try:
        core = _EngineCore(config)
    except BaseException as exc:  # noqa: BLE001 - the client must hear why
        logger.exception("engine core failed to start")
        out.send(core_encoder.encode(Failed(f"{type(exc).__name__}: {exc}")))
        out.close()
        ctx.term()
        raise SystemExit(1) from None
    try:
        out.send(core_encoder.encode(core.ready()))
        core.serve(inp, out, parent_pid)
    finally:
        core.close()
        inp.close(0)
        out.close()
        ctx.term()


class _EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        from kvserve.engine.engine import LLMEngine

        self.engine = LLMEngine(config)
        self.model = getattr(self.engine.runner, "model", None)
        self.publisher = None
        if config.kv_events_endpoint:
            from kvserve.kv.event_publisher import ZmqEventPublisher

            self.publisher = ZmqEventPublisher(
                config.kv_events_endpoint,
                config.kv_events_replay_endpoint,
                config.kv_events_topic or f"kv@{self.engine.model_name}",
                config.kv_events_buffer,
                curve_secret_key=config.kv_events_curve_secret_key,
                curve_allowed_clients=config.kv_events_curve_allowed_clients,
            )
        self.num_steps = 0
        self._text_prompts: set[str] = set()  # ids whose prompt ids the client has not had
        self._stats_time = 0.0

    def ready(self) -> Ready:
        e = self.engine
        return Ready(
            model_name=e.model_name,
            max_model_len=e.max_model_len,
            num_kv_blocks=e.num_kv_blocks,
            has_connector=e.connector is not None,
            has_expert_load=hasattr(self.model, "expert_load"),
            pid=os.getpid(),
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.shutdown()
        if self.publisher is not None:
            self.publisher.close()

    # -- loop -----------------------------------------------------------------------------
    def serve(self, inp: Any, out: Any, parent_pid: int) -> None:
        import zmq

        engine = self.engine
        send = out.send
        idle_reported = False
        while True:
            busy = engine.has_unfinished_requests()
            if not busy:
                if not idle_reported:
                    send(core_encoder.encode(self._stats()))
                    idle_reported = True
                if not inp.poll(IDLE_POLL_MS):
                    if os.getppid() != parent_pid:
                        return  # orphaned (no PDEATHSIG on this platform)
                    continue
            idle_reported = False
            while True:  # every command that has arrived, in order
                try:
                    frame = inp.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = core_decoder.decode(frame.buffer)
                if isinstance(msg, AddRequest):
                    send(core_encoder.encode(self._add(msg)))
                elif isinstance(msg, AbortRequests):
                    # Each aborted request's stream ends with its final output; an id the
                    # engine does not know had already finished (commands arrive in order).
                    outs = engine.abort_request(msg.request_ids)
                    if outs:
                        send(core_encoder.encode(self._outputs(outs)))
                elif isinstance(msg, Shutdown):
                    return
            if engine.has_unfinished_requests():
                outs = engine.step()
                self.num_steps += 1
                if outs:
                    send(core_encoder.encode(self._outputs(outs)))
            if self.publisher is not None:
                events = engine.take_kv_events()
                if events:
                    self.publisher.publish(events)
            now = time.monotonic()
            if now - self._stats_time >= STATS_INTERVAL_S:
                send(core_encoder.encode(self._stats()))

    def _add(self, msg: AddRequest) -> Accepted:
        try:
            self.engine.add_request(
                msg.request_id,
                msg.prompt,
                msg.params,
                cache_salt=msg.cache_salt,
                kv_transfer_params=msg.kv_transfer_params,
            )
        except ValueError as exc:
            return Accepted(msg.request_id, str(exc) or "invalid request")
        if isinstance(msg.prompt, str):
            self._text_prompts.add(msg.request_id)
        return Accepted(msg.request_id)

    def _outputs(self, outs: list) -> StepOutputs:
        items = []
        text_prompts = self._text_prompts
        for o in outs:
            c = o.outputs[0]
            n_new = len(o.new_token_ids)
            lps = c.logprobs
            m = o.metrics
            prompt_ids = None
            if text_prompts and o.request_id in text_prompts:
                text_prompts.discard(o.request_id)
                prompt_ids = o.prompt_token_ids
            items.append(
                CoreOutput(
                    o.request_id,
                    o.new_token_ids,
                    o.new_text,
                    o.finished,
                    (
                        m.arrival_time,
                        m.first_scheduled_time,
                        m.first_token_time,
                        m.last_token_time,
                        m.finished_time,
                        m.num_prompt_tokens,
                        m.num_cached_tokens,
                        m.num_external_cached_tokens,
                        m.num_computed_prompt_tokens,
                        m.num_preemptions,
                    ),
                    c.finish_reason,
                    c.stop_reason,
                    None if lps is None else lps[len(lps) - n_new :],
                    c.cumulative_logprob,
                    prompt_ids,
                    o.kv_transfer_params,
                )
            )
        return StepOutputs(items, self.num_steps)

    def _stats(self) -> StatsUpdate:
        import msgspec

        self._stats_time = time.monotonic()
        load = None
        if self.model is not None and hasattr(self.model, "expert_load"):
            load = {int(k): [int(x) for x in v] for k, v in self.model.expert_load().items()}
        return StatsUpdate(msgspec.to_builtins(self.engine.get_stats()), load)


if __name__ == "__main__":
    main()
