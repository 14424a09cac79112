"""Model runner: turns one :class:`SchedulerOutput` into batch tensors (input ids, positions,
slot mapping, block tables), runs the forward pass over the paged KV cache, and samples.

Owns the model weights, the sampler and the device/dtype choice, and the model's KV cache
groups (:mod:`kvserve.engine.kv_cache_spec`): which group and block slot each layer's KV
uses, and one attention metadata per group each step. It reads Request objects but never
mutates them (the scheduler appends the sampled tokens), and it does not own the KV cache
tensor's lifetime beyond allocating it (``allocate_kv_cache``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import torch

from kvserve.config import EngineConfig
from kvserve.cpu import usable_cores
from kvserve.engine.attention import (
    AttentionMetadata,
    get_attention_backend,
    set_attention_backend,
)
from kvserve.engine.attention.flashinfer_backend import AVAILABLE as FLASHINFER
from kvserve.engine.attention.flashinfer_backend import FlashInferAttentionBackend
from kvserve.engine.cpu_malloc import keep_activations_in_heap
from kvserve.engine.kv_cache_spec import (
    KVCacheGroupSpec,
    layer_slots,
    layers_per_group,
    make_kv_cache_groups,
)
from kvserve.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler, SamplingRow
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model, resolve_device, resolve_dtype
from kvserve.model.packed_linear import PackedLinear, pack_linears

logger = logging.getLogger(__name__)

# Cores left to the rest of the process on CPU engines (from RESERVE_FROM_CORES usable cores
# on): the server's event loop (HTTP, detokenizing) and the engine thread's Python between ops,
# its tokenizer process, the offload and storage threads. torch splits each op evenly over its
# threads, so one that shares its core with them holds up every op; vLLM's CPU build reserves
# one core the same way. On the shared 2-core dev box, back to back, the throughput benchmark
# (small preset, HTTP) ran bf16 at 983 / 1264 tok/s with 1 torch thread and 964 / 924 with 2;
# fp32 (compute-bound, GEMMs 3.5x slower) at 321 with 1 and 440 with 2. Heavy steps take the
# reserved core back (:func:`heavy_step_threads`), light ones leave it to the server.
RESERVED_CORES = 1
RESERVE_FROM_CORES = 2


def configure_threads(num_threads: int | None, device: torch.device) -> int:
    """Set torch's intra-op threads once per process and return the count.

    ``num_threads`` given: exactly that. Otherwise, on CPU, the usable cores minus
    :data:`RESERVED_CORES` (from :data:`RESERVE_FROM_CORES` cores on), never more than torch
    already has: its default is the physical cores (hyper-threads are left to the server), and
    a count set earlier in the process (``OMP_NUM_THREADS``, a test session's 1) is kept. On
    CUDA torch's CPU threads only prepare batches: they are left as they are."""
    if num_threads:
        if num_threads != torch.get_num_threads():
            torch.set_num_threads(num_threads)
        return num_threads
    current = torch.get_num_threads()
    if device.type != "cpu":
        return current
    cores = usable_cores()
    want = min(current, cores - RESERVED_CORES if cores >= RESERVE_FROM_CORES else cores)
    if want != current:
        torch.set_num_threads(want)
    return want


# A step whose projection GEMMs take at least this much compute is heavy (see
# :func:`heavy_step_threads`): on the dev box (AMD EPYC, 2 vCPUs, engine in its own process)
# every step of `small` at batch 64 (10.6 GFLOP in a decode step) ran 1.04-1.06x faster on
# both cores than with the decode steps on one (bf16; fp32 within noise), while `tiny`'s
# decode steps (0.4 GFLOP, ~7 ms) gained nothing and delivered tokens less evenly
# (benchmarks/results/throughput_2026-12-02f*, 02g).
HEAVY_STEP_GFLOP = 2.0


def heavy_step_threads(
    requested: int | None,
    num_threads: int,
    available: int,
    keep_reserved: bool,
    device: torch.device,
) -> int:
    """Torch threads for a heavy step (``heavy_step_min_tokens`` tokens or more).

    ``requested`` given (> 0): that. Otherwise, on CPU, ``available`` (the threads torch had
    before :func:`configure_threads` reserved a core; a test session's 1 stays 1), never fewer
    than ``num_threads``; but ``num_threads`` when ``keep_reserved``: ``num_threads`` was given
    explicitly (several engines sharing the machine pin theirs), or storage tiers are attached
    (their writer process and a local Redis work beside every step; decode under a 100 MB/s
    store stream was 0.896 of the tiers detached with heavy steps on both cores, 0.995 and
    0.949 with them on one: single runs whose pairs spread +-10%, so not conclusive, and the
    tiers keep the configuration they were measured in, benchmarks/results/tiers_small_
    2026-12-02c, -02d_threads1, -02e).

    A heavy step is compute-bound and its compute dwarfs the server's work per step: a
    2048-token prefill step ran 1.9x faster on two cores than on one (``small``, fp32 and
    bf16, offline), and the issue-16 throughput benchmark 1.24x (bf16) / 1.43x (fp32) with its
    long steps on both cores (throughput_2026-12-02d). A light step keeps the reserved core
    free for the server, which streams its tokens meanwhile. Switching costs ~0.2 us
    (``omp_set_num_threads``; libgomp keeps its thread pool)."""
    if requested:
        return requested
    if device.type != "cpu" or keep_reserved:
        return num_threads
    return max(num_threads, min(available, usable_cores()))


def heavy_step_min_tokens(model: torch.nn.Module, gflop: float = HEAVY_STEP_GFLOP) -> int:
    """Tokens whose projections take ``gflop`` on ``model``: 2 FLOPs per weight of its linear
    layers per token (the LM head, which runs for sampled tokens only, not counted; stacked
    MoE expert weights are not linear layers, so a MoE model counts its dense part)."""
    weights = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "lm_head":
            continue
        if isinstance(module, torch.nn.Linear):
            weights += module.weight.numel()
        elif isinstance(module, PackedLinear):
            weights += module.in_features * module.out_features
    return max(1, math.ceil(gflop * 1e9 / (2 * max(1, weights))))


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        if not config.model:
            raise ValueError("EngineConfig.model (a local model directory) is required")
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.device = resolve_device(config.device)
        available = torch.get_num_threads()
        self.num_threads = configure_threads(config.num_threads, self.device)
        storage_tiers = bool(config.kv_tier or config.kv_tiers_config)
        self.heavy_step_threads = heavy_step_threads(
            config.heavy_step_threads, self.num_threads, available,
            bool(config.num_threads) or storage_tiers, self.device,
        )  # fmt: skip
        if self.device.type == "cpu":
            keep_activations_in_heap()  # no page faults for each step's large activations
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.torch_dtype)
        self.block_size = config.block_size
        self.model = load_model(
            config.model, dtype=self.dtype, device=self.device, config=self.model_config
        )
        # fp32 projections through oneDNN's packed GEMM (load_model leaves fp32 on torch's
        # BLAS, bitwise transformers): 1.75-2x faster on the dev box, logits within ~1e-5.
        pack_linears(self.model, fp32=True)
        self.heavy_step_min_tokens = config.heavy_step_min_tokens or heavy_step_min_tokens(
            self.model
        )
        self.kv_cache_groups = self._make_kv_cache_groups()
        self.attn_backend = self._pick_attention_backend()
        set_attention_backend(self.model, self.attn_backend)
        self.sampler = Sampler(config.seed)
        self.kv_cache: torch.Tensor | None = None
        max_len = self.model_config.max_context_len
        if config.max_model_len is not None and config.max_model_len > max_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's {max_len} positions"
            )
        self.max_model_len = config.max_model_len or max_len
        self.vocab_size = self.model_config.vocab_size

    def _make_kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        """The model's KV cache groups (one when ``kv_groups`` is off or a KV connector that
        moves whole blocks of every layer is configured; the offload connector's host and
        storage tiers and the pd connector move them per group), bound to its attention
        layers."""
        cfg = self.config
        enable = cfg.kv_groups
        per_group = cfg.kv_connector in ("offload", "pd")
        if enable and cfg.kv_connector and not per_group:
            groups = make_kv_cache_groups(self.model_config, enable=True)
            if len(groups) > 1 or groups[0].spec.sliding_window is not None:
                logger.warning(
                    "KV cache groups are off: the %s connector moves every layer's KV",
                    self.config.kv_connector,
                )
                enable = False
        groups = make_kv_cache_groups(self.model_config, enable=enable)
        slots = layer_slots(groups)
        for module in self.model.modules():
            if hasattr(module, "kv_slot") and hasattr(module, "layer_idx"):
                module.kv_group, module.kv_slot = slots[module.layer_idx]
        return groups

    def _pick_attention_backend(self):
        """KERNEL's choice (``get_attention_backend``), except that ``auto`` on CUDA takes
        FlashInfer when it imports (``KVSERVE_ATTENTION_BACKEND=torch`` keeps torch) and the
        model has one KV cache group (its plan covers one set of page tables)."""
        name = self.config.attention_backend
        env = os.environ.get("KVSERVE_ATTENTION_BACKEND") or "auto"
        one_group = len(self.kv_cache_groups) == 1
        if (
            self.device.type == "cuda"
            and name == "auto"
            and env == "auto"
            and FLASHINFER
            and one_group
        ):
            m = self.model_config
            backend = FlashInferAttentionBackend(self.device)
            backend.configure(
                m.num_attention_heads, m.num_key_value_heads, m.head_dim, self.dtype,
                m.attn_scale,
            )  # fmt: skip
            return backend
        return get_attention_backend(self.device, name)

    # -- KV cache ------------------------------------------------------------------------
    @property
    def kv_cache_shape_per_block(self) -> tuple[int, ...]:
        m = self.model_config
        n = layers_per_group(self.kv_cache_groups)
        return (n, 2, self.block_size, m.num_key_value_heads, m.head_dim)

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block: K and V of the layers of one KV cache group (every layer
        when the model has one group)."""
        n = 1
        for d in self.kv_cache_shape_per_block:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """``[num_blocks, layers_per_group, 2, block_size, H_kv, D]`` zeros (``num_layers``
        per block with one KV cache group); block 0 is the null block. The runner keeps a
        reference and uses it for every step."""
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is reserved)")
        self.kv_cache = torch.zeros(
            (num_blocks, *self.kv_cache_shape_per_block), dtype=self.dtype, device=self.device
        )
        return self.kv_cache

    # -- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens and sample one token for every request whose
        scheduled tokens reach the end of ``all_token_ids``."""
        self.sampler.drop(scheduler_output.finished_req_ids)
        output = ModelRunnerOutput()
        batch = self._prepare(scheduler_output)
        if batch is None:
            return output
        reqs, meta, ids_t, pos_t = batch
        hidden = self.model(ids_t, pos_t, meta, self.kv_cache)
        sampling: list[Request] = []
        sample_idx: list[int] = []  # flat index of the last token of requests that sample
        for i, r in enumerate(reqs):
            output.sampled_token_ids[r.request_id] = []
            end = meta.query_start_loc[i + 1]
            if r.num_computed_tokens + (end - meta.query_start_loc[i]) == r.num_tokens:
                sampling.append(r)
                sample_idx.append(end - 1)
        if not sampling:
            return output
        if len(sample_idx) == hidden.shape[0]:  # e.g. a decode-only step: every row samples
            logits = self.model.compute_logits(hidden)
        else:
            idx = self._tensor(sample_idx)
            logits = self.model.compute_logits(hidden.index_select(0, idx))
        rows = [
            SamplingRow(r.request_id, r.sampling_params, r.num_output_tokens, r.eos_token_id)
            for r in sampling
        ]
        token_ids, logprobs = self.sampler(logits, rows)
        for r, tok, lp in zip(sampling, token_ids, logprobs, strict=True):
            output.sampled_token_ids[r.request_id] = [tok]
            if lp is not None:
                output.logprobs[r.request_id] = [lp]
        return output

    @torch.inference_mode()
    def compute_all_logits(self, scheduler_output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Like :meth:`execute_model` (KV written the same way) but return fp32 logits of every
        scheduled token, ``{request_id: [num_scheduled, vocab]}``, and sample nothing
        (prompt logprobs, parity tests)."""
        batch = self._prepare(scheduler_output)
        if batch is None:
            return {}
        reqs, meta, ids_t, pos_t = batch
        logits = self.model.compute_logits(self.model(ids_t, pos_t, meta, self.kv_cache)).float()
        q = meta.query_start_loc
        return {r.request_id: logits[q[i] : q[i + 1]] for i, r in enumerate(reqs)}

    def _prepare(
        self, so: SchedulerOutput
    ) -> tuple[list[Request], AttentionMetadata, torch.Tensor, torch.Tensor] | None:
        n_sched = so.num_scheduled_tokens
        reqs = [r for r in so.scheduled if n_sched.get(r.request_id, 0) > 0]
        if not reqs:
            return None
        if self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() must be called before execute_model()")
        # Decodes (one query token) first; stable, so prefills keep the scheduler's order.
        reqs.sort(key=lambda r: n_sched[r.request_id] != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, computed, tables = [], [], []
        num_groups = len(self.kv_cache_groups)
        group_tables: list[list[list[int]]] | None = None
        if num_groups > 1:
            group_tables = [[] for _ in range(num_groups)]
        for r in reqs:
            c, n = r.num_computed_tokens, n_sched[r.request_id]
            if c + n > r.num_tokens:
                raise ValueError(
                    f"request {r.request_id}: cannot compute {n} tokens after {c} "
                    f"(it has {r.num_tokens})"
                )
            if c + n > self.max_model_len:
                raise ValueError(f"request {r.request_id} exceeds max_model_len")
            input_ids.extend(r.all_token_ids[c : c + n])
            positions.extend(range(c, c + n))
            query_lens.append(n)
            computed.append(c)
            if group_tables is None:
                tables.append(so.block_ids[r.request_id])
            else:
                per_group = so.group_block_ids.get(r.request_id)
                if per_group is None or len(per_group) != num_groups:
                    raise ValueError(
                        f"request {r.request_id}: the model has {num_groups} KV cache groups; "
                        "the scheduler output needs a block table per group"
                    )
                tables.append(per_group[0])
                for g in range(num_groups):
                    group_tables[g].append(per_group[g])
        # Built on the host; on a GPU its tensors go over in pinned, non-blocking copies.
        meta = AttentionMetadata.build(
            block_size=self.block_size,
            query_lens=query_lens,
            num_computed=computed,
            block_tables=tables,
            group_block_tables=group_tables,
        )
        if input_ids and not 0 <= min(input_ids) <= max(input_ids) < self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        self._set_step_threads(len(input_ids))
        if self.device.type != "cpu":
            plan = getattr(self.attn_backend, "plan", None)
            if plan is not None:  # FlashInfer: page lists from the host-side metadata
                plan(meta)
            self._metadata_to_device(meta)
        return reqs, meta, self._tensor(input_ids), self._tensor(positions)

    def _set_step_threads(self, num_tokens: int) -> None:
        """Torch's threads for a step of ``num_tokens`` tokens: :attr:`heavy_step_threads` from
        :attr:`heavy_step_min_tokens` on, else :attr:`num_threads` (called on the thread that
        runs the forward pass: OpenMP's thread count is that thread's setting)."""
        heavy = num_tokens >= self.heavy_step_min_tokens
        want = self.heavy_step_threads if heavy else self.num_threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        """A long tensor on the device; on a GPU from pinned memory without a host sync."""
        t = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _metadata_to_device(self, meta: AttentionMetadata) -> None:
        """Move every tensor of ``meta`` (and of its prefills) to the device: pinned host
        memory and ``non_blocking`` copies, so the step never waits for the GPU here."""
        objs = [o for m in (meta.groups or [meta]) for o in (m, *m.prefills)]
        for obj in objs:
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if isinstance(value, torch.Tensor) and value.device != self.device:
                    value = value.pin_memory().to(self.device, non_blocking=True)
                    setattr(obj, f.name, value)
