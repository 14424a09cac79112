"""Tokenization for the server without blocking its event loop.

Small inputs (at most :data:`INLINE_CHARS` characters, ~1 ms for a BPE tokenizer) are
tokenized on the loop, as before: a process hop would cost more than it saves. Larger ones go
to worker processes (:mod:`kvserve.server.tokenizer_worker`), which hold their own copy of the
tokenizer; the loop only hands over the text. Each worker has a writer and a reader thread
(blocking pipe I/O releases the GIL), so a busy worker never blocks the loop and any loop can
await a job. Workers start on first use and restart after a crash or a job that runs past
:data:`JOB_TIMEOUT_S` (its requests get 503). One pool per tokenizer directory and size is
shared by every app of a process (the simulator serves many engines from one process).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import subprocess
import sys
import threading
from typing import Any

import msgspec

from kvserve.server import tokenizer_worker as worker_mod

logger = logging.getLogger(__name__)

INLINE_CHARS = 4096  # inputs up to this many characters are tokenized on the loop
INLINE_MESSAGES = 64  # chats with more messages are templated in a worker
JOB_TIMEOUT_S = 120.0  # a job running longer than this kills its worker


class TokenizerUnavailable(RuntimeError):
    """The worker died or timed out; the request can be retried."""


class _Worker:
    """One worker process, its writer and reader threads, and the jobs it holds."""

    def __init__(self, tokenizer_dir: str) -> None:
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.server.tokenizer_worker", tokenizer_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()
        self._jobs: dict[int, concurrent.futures.Future] = {}
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.alive = True
        threading.Thread(target=self._write, name="kvserve-tok-writer", daemon=True).start()
        threading.Thread(target=self._read, name="kvserve-tok-reader", daemon=True).start()

    @property
    def num_pending(self) -> int:
        return len(self._jobs)

    def submit(self, job_id: int, op: str, args: list[Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                raise TokenizerUnavailable("tokenizer worker is not running")
            self._jobs[job_id] = fut
        self._outbox.put(self._encoder.encode([job_id, op, *args]))
        return fut

    def _write(self) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            while (payload := self._outbox.get()) is not None:
                stdin.write(worker_mod.frame(payload))
                stdin.flush()
                del payload
        except (OSError, ValueError):  # the worker went away: the reader fails the jobs
            pass
        finally:
            with contextlib.suppress(OSError):
                stdin.close()

    def _read(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        decoder = msgspec.msgpack.Decoder()
        try:
            while (payload := worker_mod.read_frame(stdout)) is not None:
                job_id, status, value = decoder.decode(payload)
                with self._lock:
                    fut = self._jobs.pop(job_id, None)
                if fut is not None and not fut.done():
                    # InvalidStateError: cancelled meanwhile
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        fut.set_result((status, value))
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            logger.error("tokenizer worker: bad reply: %r", exc)
        self._fail_all(TokenizerUnavailable("the tokenizer worker exited"))

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self.alive = False
            jobs, self._jobs = list(self._jobs.values()), {}
        for fut in jobs:
            if not fut.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    fut.set_exception(exc)
        self._outbox.put(None)

    def kill(self) -> None:
        with self._lock:
            self.alive = False
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self, timeout: float = 5.0) -> None:
        """Close stdin (the worker exits at end of input); kill it if it does not."""
        with self._lock:
            self.alive = False
        self._outbox.put(None)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class TokenizerPool:
    """``await pool.encode(...)`` / ``await pool.encode_chat(...)``: inline or in a worker."""

    _shared: dict[tuple[str, int], tuple[TokenizerPool, int]] = {}
    _shared_lock = threading.Lock()

    def __init__(self, tokenizer: Any, tokenizer_dir: str, num_workers: int = 1) -> None:
        self.tokenizer = tokenizer  # the engine's, for inline jobs
        self.tokenizer_dir = tokenizer_dir
        self.num_workers = num_workers
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()

    # -- sharing --------------------------------------------------------------------------
    @classmethod
    def acquire(cls, tokenizer: Any, tokenizer_dir: str, num_workers: int) -> TokenizerPool:
        key = (os.path.realpath(tokenizer_dir), num_workers)
        with cls._shared_lock:
            pool, refs = cls._shared.get(key, (None, 0))
            if pool is None:
                pool = cls(tokenizer, tokenizer_dir, num_workers)
            cls._shared[key] = (pool, refs + 1)
            return pool

    def release(self) -> None:
        key = (os.path.realpath(self.tokenizer_dir), self.num_workers)
        with self._shared_lock:
            pool, refs = self._shared.get(key, (None, 0))
            if pool is not self:
                return
            if refs > 1:
                self._shared[key] = (pool, refs - 1)
                return
            del self._shared[key]
        self.close()

    # -- jobs -----------------------------------------------------------------------------
    async def encode(self, text: str, max_chars: int, limit: int) -> tuple[str, Any]:
        """Token ids of a completions prompt (``run_job`` statuses)."""
        return await self._run("encode", [text, max_chars, limit], len(text) <= INLINE_CHARS)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        max_chars: int,
        limit: int,
    ) -> tuple[str, Any]:
        """Token ids of a chat conversation rendered with the model's template."""
        size = sum(_content_chars(m.get("content")) for m in messages)
        small = size <= INLINE_CHARS and len(messages) <= INLINE_MESSAGES
        args = [messages, add_generation_prompt, template_kwargs, max_chars, limit]
        return await self._run("chat", args, small)

    async def _run(self, op: str, args: list[Any], small: bool) -> tuple[str, Any]:
        if small or self.num_workers <= 0:
            return worker_mod.run_job(self.tokenizer, op, args)
        worker = self._worker()
        fut = worker.submit(next(self._ids), op, args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), JOB_TIMEOUT_S)
        except TimeoutError:
            logger.error("tokenizer job ran past %.0f s: restarting its worker", JOB_TIMEOUT_S)
            worker.kill()
            raise TokenizerUnavailable("tokenization timed out") from None

    def _worker(self) -> _Worker:
        with self._lock:
            self._workers = [w for w in self._workers if w.alive]
            if len(self._workers) < self.num_workers:
                self._workers.append(_Worker(self.tokenizer_dir))
            return min(self._workers, key=lambda w: w.num_pending)

    @property
    def num_running_workers(self) -> int:
        return sum(1 for w in self._workers if w.alive and w.proc.poll() is None)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.alive]

    def close(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, []
        for w in workers:
            w.close()


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return 0
