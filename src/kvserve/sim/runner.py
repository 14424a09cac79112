"""SimModelRunner: the engine's model runner with the model replaced by a latency model.

Owns the modelled step: from a :class:`SchedulerOutput` it computes the step's shape (prefill
tokens, attention context, decodes), sleeps the modelled time (times ``time_scale``; a sleep,
never a busy wait) and samples deterministic pseudo-random tokens. Everything else, block
pool, prefix caching, scheduling, connector, events, metrics, is the real engine's code: the
simulator *is* ``LLMEngine(config, runner=SimModelRunner(...))``.

Sampled tokens depend only on (seed, the previous token, the position), so the same prompt
gives the same output on every instance and run, like greedy decoding. EOS and other special
tokens are never sampled: a request runs to its ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field

from kvserve.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.sim.latency_model import LatencyModel, StepShape, prefill_chunk_attn

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_shape(so: SchedulerOutput) -> StepShape:
    """The token counts of one step (decodes: one new token at the end of the sequence)."""
    prefill = decode_seqs = decode_ctx = 0
    attn = 0.0
    n_sched = so.num_scheduled_tokens
    for r in so.scheduled:
        n = n_sched.get(r.request_id, 0)
        if n <= 0:
            continue
        c = r.num_computed_tokens
        if n == 1 and c == r.num_tokens - 1 and r.num_output_tokens > 0:
            decode_seqs += 1
            decode_ctx += c + 1
        else:
            prefill += n
            attn += prefill_chunk_attn(c, n)
    return StepShape(prefill, attn, decode_seqs, decode_ctx)


@dataclass
class SimModelConfig:
    """The parts of a model config the engine reads."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_id: list[int] = field(default_factory=list)  # the tokenizer's EOS suffices

    @property
    def max_context_len(self) -> int:
        return self.max_position_embeddings


@dataclass
class SimRunnerStats:
    """Totals since start (modelled seconds are before ``time_scale``)."""

    steps: int = 0
    modelled_s: float = 0.0
    slept_s: float = 0.0  # wall seconds actually slept
    overrun_s: float = 0.0  # wall time past a step's modelled end (CPU contention)
    busy_wall_s: float = 0.0  # wall time of busy steps, engine overhead between them included
    busy_modelled_s: float = 0.0  # their modelled time (x time_scale: the ideal busy wall)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    last_step: StepShape = field(default_factory=StepShape)


class SimModelRunner:
    """Implements the runner interface ``LLMEngine`` uses (see ``engine/model_runner.py``)."""

    device = "sim"
    dtype = "sim"

    def __init__(
        self,
        latency: LatencyModel,
        *,
        vocab_size: int,
        block_size: int = 16,
        max_model_len: int | None = None,
        time_scale: float = 1.0,
        seed: int = 0,
        special_ids: frozenset[int] | set[int] = frozenset(),
    ) -> None:
        if time_scale < 0 or not math.isfinite(time_scale):
            raise ValueError("time_scale must be a finite number >= 0")
        if vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")
        self.latency = latency
        self.block_size = block_size
        self.time_scale = float(time_scale)
        self.seed = int(seed)
        self.model_config = SimModelConfig(vocab_size, max_model_len or latency.max_model_len)
        self._allowed = [i for i in range(vocab_size) if i not in set(special_ids)]
        if not self._allowed:
            raise ValueError("no ordinary token ids to sample")
        self.stats = SimRunnerStats()
        self.kv_cache: object | None = None
        self._last_end: float | None = None
        self._lock = threading.Lock()  # stats are read from other threads

    # -- KV cache: nothing to hold, only its modelled size -------------------------------
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block of the *modelled* model (sizes the pool and the tiers)."""
        return max(1, self.latency.block_bytes(self.block_size))

    def allocate_kv_cache(self, num_blocks: int) -> object:
        """No memory: a placeholder the engine and the sim offload connector pass around."""
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is reserved)")
        self.kv_cache = SimKVCache(num_blocks, self.kv_block_bytes())
        return self.kv_cache

    # -- one step -----------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        shape = step_shape(scheduler_output)
        modelled = self.latency.step_time(shape)
        self._sleep(modelled * self.time_scale)
        out = ModelRunnerOutput()
        n_sched = scheduler_output.num_scheduled_tokens
        logprob = -math.log(self.model_config.vocab_size)
        for r in scheduler_output.scheduled:
            n = n_sched.get(r.request_id, 0)
            if n <= 0:
                continue
            out.sampled_token_ids[r.request_id] = []
            if r.num_computed_tokens + n != r.num_tokens:
                continue  # partial prefill: nothing sampled
            tok = self.sample(r.all_token_ids[-1], r.num_tokens, r.sampling_params.seed)
            out.sampled_token_ids[r.request_id] = [tok]
            if r.sampling_params.logprobs is not None:
                # The modelled distribution is uniform over the vocabulary.
                out.logprobs[r.request_id] = [(logprob, {tok: logprob})]
        with self._lock:
            s = self.stats
            s.steps += 1
            s.modelled_s += modelled
            s.prefill_tokens += shape.prefill_tokens
            s.decode_tokens += shape.decode_seqs
            s.last_step = shape
        return out

    def sample(self, prev_token: int, position: int, seed: int | None = None) -> int:
        x = _mix64((self.seed if seed is None else seed) * 0x1000193 ^ prev_token << 24 ^ position)
        return self._allowed[x % len(self._allowed)]

    def _sleep(self, seconds: float) -> None:
        """Sleep until the step's modelled end. The engine's own work since the previous
        step ended (scheduling, outputs) counts against the step's fixed overhead, so a
        busy engine keeps the modelled pace instead of adding Python time to every step."""
        now = time.perf_counter()
        ideal = seconds
        fixed = self.latency.fixed * self.time_scale
        busy = False
        if self._last_end is not None:
            gap = now - self._last_end
            busy = gap < 4 * fixed  # the gap was the engine's own overhead, else idle
            if busy:
                seconds -= min(gap, fixed)
        end = now + max(0.0, seconds)
        if seconds > 0:
            time.sleep(seconds)
        done = time.perf_counter()
        with self._lock:
            s = self.stats
            s.slept_s += done - now
            s.overrun_s += max(0.0, done - end)
            if busy:
                assert self._last_end is not None
                s.busy_wall_s += done - self._last_end
                s.busy_modelled_s += ideal
        self._last_end = done

    def snapshot(self) -> SimRunnerStats:
        with self._lock:
            s = self.stats
            return dataclasses.replace(s)


@dataclass(frozen=True)
class SimKVCache:
    """Stands in for the KV tensor: the modelled pool's size, no storage."""

    num_blocks: int
    block_bytes: int

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes
