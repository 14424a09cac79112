"""The sparse mixture-of-experts block (Qwen3-MoE, Mixtral): top-k softmax routing and the
experts this process owns.

Experts are computed grouped, never densely: the (token, slot) pairs are sorted by expert id,
each active expert runs two GEMMs on its contiguous slice, and the weighted results are
added back to their tokens (``index_add_``, in ascending expert order as ``transformers``
does). With an expert-parallel group the sorted rows go through
:class:`kvserve.engine.parallel.dispatch.AllToAllDispatcher` to the ranks that own their
experts and come back computed. Tokens routed to each expert are counted (expert load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.parallel.state import get_expert_parallel_group
from kvserve.model.config import ModelConfig


class SparseMoeBlock(nn.Module):
    """Router ``gate`` ``[E, H]``; local experts ``w13`` ``[E_local, 2I, H]`` (gate rows then
    up rows) and ``w2`` ``[E_local, H, I]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, inter, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.num_experts, self.top_k = e, config.num_experts_per_tok
        self.intermediate_size = inter
        self.norm_topk_prob = config.norm_topk_prob
        # Mixtral keeps the routing weights in fp32; Qwen3-MoE casts them to the model dtype.
        self.fp32_routing_weights = config.architecture == "MixtralForCausalLM"
        self.gate = nn.Linear(h, e, bias=False)
        ep = get_expert_parallel_group()
        self.expert_start, self.expert_end = ep.expert_range(e) if ep else (0, e)
        n_local = self.expert_end - self.expert_start
        self.w13 = nn.Parameter(torch.empty(n_local, 2 * inter, h))
        self.w2 = nn.Parameter(torch.empty(n_local, h, inter))
        self.dispatcher = None
        if ep is not None and ep.world_size > 1:
            from kvserve.engine.parallel.dispatch import AllToAllDispatcher

            self.dispatcher = AllToAllDispatcher(ep, e)
        # Tokens routed to each expert since start (all experts, counted where routed).
        self.expert_tokens = torch.zeros(e, dtype=torch.int64, device="cpu")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, H]`` -> routing weights and expert ids, both ``[T, top_k]``."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_routing_weights:
            weights = weights.to(logits.dtype)
        return weights, ids

    def compute_experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """SwiGLU of local expert ``i`` on the ``counts[i]`` rows of its slice (rows sorted by
        local expert id)."""
        out = torch.empty_like(rows)
        start = 0
        inter = self.intermediate_size
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate_up = F.linear(rows[start : start + n], self.w13[e])
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out[start : start + n] = F.linear(act, self.w2[e])
            start += n
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.expert_tokens.device != counts.device:
            self.expert_tokens = self.expert_tokens.to(counts.device)
        self.expert_tokens += counts
        rows = x.index_select(0, tokens)
        if self.dispatcher is not None:
            y = self.dispatcher(rows, counts, self.compute_experts)
        else:
            y = self.compute_experts(rows, counts.tolist())
        y = (y * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, y)
