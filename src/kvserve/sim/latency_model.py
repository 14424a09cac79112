"""The simulator's latency model: how long one engine step and one KV transfer take.

Owns the step-time formula and the named hardware/model presets; knows nothing of requests,
blocks or threads (the runner feeds it token counts, the offload connector byte counts).

One step computes a batch of prefill chunks and decodes (``SchedulerOutput``). Its time is::

    step = fixed
         + prefill_per_token   * sum(new prefill tokens)
         + prefill_attn_per_ctx * sum over prefill chunks of new_tokens * mean context
         + decode_per_seq      * (decoding requests)
         + decode_per_ctx      * sum over decoding requests of their context length

``fixed`` is the per-step cost independent of the batch (reading the weights once, kernel
launches, scheduling); the prefill terms are the GEMMs (linear in tokens) and attention
(tokens x context); the decode terms are per-sequence compute and reading each sequence's KV.
A KV transfer between tiers takes ``latency + bytes / bandwidth``; one between instances
(P/D: a decode instance pulling a prefill instance's blocks) ``net_latency + bytes /
net_bandwidth``.

Presets (every default carries its source below):

- ``h100-llama8b``: Llama-3.1-8B (bf16) on one H100 SXM 80 GB, derived from the roofline of
  the hardware and cross-checked against published vLLM measurements;
- ``cpu-tiny``: the real kvserve engine on this kind of machine (2 CPU cores, torch, the
  ``tiny`` preset), fitted by ``python -m kvserve.sim.calibrate``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in token counts (built by the runner from a SchedulerOutput)."""

    prefill_tokens: int = 0  # new prompt tokens computed this step (all chunks)
    prefill_attn: float = 0.0  # sum over chunks of new_tokens * mean context of the chunk
    decode_seqs: int = 0  # requests generating one token
    decode_ctx: int = 0  # sum of their context lengths (tokens whose KV is read)

    @property
    def is_empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0


def prefill_chunk_attn(num_computed: int, num_new: int) -> float:
    """``num_new * mean context`` of a chunk computing tokens ``num_computed ..
    num_computed + num_new - 1`` (each token attends to itself and everything before)."""
    return num_new * (num_computed + (num_new + 1) / 2.0)


@dataclass(frozen=True)
class LatencyModel:
    """Per-step and per-transfer costs in seconds (see the module docstring's formula)."""

    name: str = "custom"
    fixed: float = 0.0  # s per non-empty step
    prefill_per_token: float = 0.0  # s per new prompt token
    prefill_attn_per_ctx: float = 0.0  # s per (new prompt token x context token)
    decode_per_seq: float = 0.0  # s per decoding request
    decode_per_ctx: float = 0.0  # s per context token of decoding requests
    kv_bytes_per_token: int = 0  # KV of one token, all layers, K and V (bytes)
    cpu_bandwidth: float = 0.0  # bytes/s between the primary pool and host memory (0: instant)
    transfer_latency: float = 0.0  # s per transfer job (submission, synchronization)
    net_bandwidth: float = 0.0  # bytes/s of one instance's network link, each way (0: instant)
    net_latency: float = 0.0  # s per pull between instances (handshake, notification)
    # Shape of the modelled model, for the engine (context limit) and sizing the pool.
    max_model_len: int = 131072
    default_kv_tokens: int = 0  # primary-pool capacity in tokens of one instance (0: unset)
    source: str = ""

    def step_time(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        return (
            self.fixed
            + self.prefill_per_token * shape.prefill_tokens
            + self.prefill_attn_per_ctx * shape.prefill_attn
            + self.decode_per_seq * shape.decode_seqs
            + self.decode_per_ctx * shape.decode_ctx
        )

    def prefill_time(self, num_tokens: int, num_cached: int = 0) -> float:
        """One request's prefill alone in a step (no decodes batched with it)."""
        n = max(0, num_tokens - num_cached)
        return self.step_time(StepShape(n, prefill_chunk_attn(num_cached, n)))

    def decode_step_time(self, batch: int, context: int) -> float:
        """A step of ``batch`` decodes, each with ``context`` tokens of KV."""
        return self.step_time(StepShape(decode_seqs=batch, decode_ctx=batch * context))

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def transfer_time(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` of KV between the primary pool and host memory."""
        if nbytes <= 0:
            return 0.0
        bw = self.cpu_bandwidth
        return self.transfer_latency + (nbytes / bw if bw > 0 else 0.0)

    def net_transfer_time(self, nbytes: int) -> float:
        """Seconds to pull ``nbytes`` of KV from another instance (P/D)."""
        if nbytes <= 0:
            return 0.0
        bw = self.net_bandwidth
        return self.net_latency + (nbytes / bw if bw > 0 else 0.0)

    def replace(self, **changes: float) -> LatencyModel:
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Presets
#
# h100-llama8b. Llama-3.1-8B: 32 layers, hidden 4096, 8 KV heads x head dim 128, 8.0e9
# parameters (Meta's config.json). H100 SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16 (NVIDIA
# H100 datasheet).
# - kv_bytes_per_token = 32 layers x 2 (K, V) x 8 heads x 128 x 2 bytes = 131072 (128 KiB).
# - fixed = 6 ms: reading 16 GB of bf16 weights once per step at ~3.35 TB/s is 4.8 ms, plus
#   ~1 ms launch/scheduling overhead; matches the ~6-7 ms single-request ITL vLLM reports for
#   8B models on H100 (LambdaLabs vllm-benchmark, Ori "Benchmarking Llama 3.1 8B Instruct on
#   H100 and A100 with vLLM" blog posts).
# - prefill_per_token = 55 us (~18k tok/s): 2 x 8e9 FLOP per token at ~300 TFLOP/s achieved
#   (30 % of peak, typical for vLLM GEMMs at these shapes); published H100 prefill for 8B
#   models is 10-20k tok/s (vLLM benchmark_serving runs; MLPerf v5.1 Llama-3.1-8B FP8 offline
#   5.8k tok/s total on one H100 includes decode-heavy samples).
# - prefill_attn_per_ctx = 1.3 ns: attention costs 4 x layers x hidden = 5.2e5 FLOP per
#   (query token x context token); FlashAttention-2/3 at ~400 TFLOP/s achieved.
# - decode_per_seq = 60 us: per-sequence GEMM rows, sampling and bookkeeping at small batch.
# - decode_per_ctx = 45 ns: 128 KiB of KV read per context token at ~2.9 TB/s achieved.
#   Together: batch 32 at 4k context -> 6 + 1.9 + 5.9 = 13.8 ms ITL, in the 10-20 ms range
#   published for moderate batches (Azure ND-H100-v5 vLLM Llama 3.1 8B blog, Aug 2025).
# - cpu_bandwidth = 50 GB/s one way over PCIe 5.0 (anchors.md: vLLM's offloading connector
#   measured ~50 GB/s; PCIe 5.0 x16 is 64 GB/s raw); transfer_latency 20 us per job.
# - net_bandwidth = 50 GB/s: one 400 Gb/s RDMA NIC per GPU (ConnectX-7, the usual H100 node:
#   8 GPUs, 8 NICs), line rate; net_latency = 1 ms per pull: the decode leg's admission, the
#   transfer's handshake and completion notice (NIXL-style), not the bytes.
# - default_kv_tokens = 430k: (80 GB x 0.9 - 16 GB weights - ~2 GB activations) / 128 KiB
#   per token, the "GPU KV cache size" vLLM logs for this model on an 80 GB card.
H100_LLAMA8B = LatencyModel(
    name="h100-llama8b",
    fixed=6.0e-3,
    prefill_per_token=55e-6,
    prefill_attn_per_ctx=1.3e-9,
    decode_per_seq=60e-6,
    decode_per_ctx=45e-9,
    kv_bytes_per_token=131072,
    cpu_bandwidth=50 * GB,
    transfer_latency=20e-6,
    net_bandwidth=50 * GB,
    net_latency=1e-3,
    max_model_len=131072,
    default_kv_tokens=430_000,
    source="roofline of H100 SXM (3.35 TB/s, 989 TFLOP/s bf16) for Llama-3.1-8B, "
    "cross-checked with published vLLM H100 measurements (see latency_model.py)",
)

# cpu-tiny: the real kvserve engine running the ``tiny`` preset (4 layers, hidden 256, 2 KV
# heads x 64, fp32; torch CPU, one thread) on this project's 2-core x86 build machine, fitted
# by ``python -m kvserve.sim.calibrate --preset tiny --repeats 2`` (non-negative least squares,
# relative error weighting, over whole ``engine.step()`` calls: prefills of 16..1024 tokens
# and decode steps of batch 1..32 at contexts 32..1024; the engine thread's CPU time, since
# the machine was shared; mean fit error 9.6%, max 30%). KV per token: 4 layers x 2 x 2 heads
# x 64 x 4 bytes = 4 KiB. "Transfers" on a CPU engine are block copies within RAM: 6.0 GB/s
# measured by the same script with the offload connector's ``copy_blocks`` on one thread
# (5.7-6.4 with streaming stores; it was 4.3 with numpy's memcpy). Between instances
# (P/D over loopback TCP): 2 GB/s and 1 ms per pull, an order of magnitude, not a fit.
CPU_TINY = LatencyModel(
    name="cpu-tiny",
    fixed=10.8e-3,
    prefill_per_token=235e-6,
    prefill_attn_per_ctx=0.593e-6,
    decode_per_seq=0.579e-3,
    decode_per_ctx=4.72e-6,
    kv_bytes_per_token=4096,
    cpu_bandwidth=6.0 * GB,
    transfer_latency=50e-6,
    net_bandwidth=2.0 * GB,
    net_latency=1e-3,
    max_model_len=2048,
    default_kv_tokens=262_144,
    source="fitted to the real engine (tiny preset, CPU, 1 thread) by kvserve.sim.calibrate",
)

PRESETS: dict[str, LatencyModel] = {m.name: m for m in (H100_LLAMA8B, CPU_TINY)}


def get_preset(name: str) -> LatencyModel:
    try:
        return PRESETS[name]
    except KeyError:
        known = sorted(PRESETS)
        raise ValueError(f"unknown latency preset {name!r}; choose from {known}") from None
