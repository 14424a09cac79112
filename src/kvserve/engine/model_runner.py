"""Model runner: turns one :class:`SchedulerOutput` into batch tensors (input ids, positions,
slot mapping, block tables), runs the forward pass over the paged KV cache, and samples.

Owns the model weights, the sampler and the device/dtype choice. It reads Request objects but
never mutates them (the scheduler appends the sampled tokens), and it does not own the KV
cache tensor's lifetime beyond allocating it (``allocate_kv_cache``).
"""

from __future__ import annotations

import torch

from kvserve.config import EngineConfig
from kvserve.engine.attention import (
    AttentionMetadata,
    get_attention_backend,
    set_attention_backend,
)
from kvserve.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler, SamplingRow
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model, resolve_device, resolve_dtype


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        if not config.model:
            raise ValueError("EngineConfig.model (a local model directory) is required")
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.model = load_model(
            config.model, dtype=self.dtype, device=self.device, config=self.model_config
        )
        self.attn_backend = get_attention_backend(self.device, config.attention_backend)
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

    # -- KV cache ------------------------------------------------------------------------
    @property
    def kv_cache_shape_per_block(self) -> tuple[int, ...]:
        m = self.model_config
        return (m.num_hidden_layers, 2, self.block_size, m.num_key_value_heads, m.head_dim)

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block across all layers (K and V)."""
        n = 1
        for d in self.kv_cache_shape_per_block:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """``[num_blocks, num_layers, 2, block_size, H_kv, D]`` zeros; block 0 is the null
        block. The runner keeps a reference and uses it for every step."""
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
            idx = torch.tensor(sample_idx, device=self.device)
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
            tables.append(so.block_ids[r.request_id])
        meta = AttentionMetadata.build(
            block_size=self.block_size,
            query_lens=query_lens,
            num_computed=computed,
            block_tables=tables,
            device=self.device,
        )
        if input_ids and not 0 <= min(input_ids) <= max(input_ids) < self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return reqs, meta, ids_t, pos_t
