"""Token dispatch and combine between expert-parallel ranks (one MoE layer, one step).

Rows arrive sorted by global expert id, so the rows for each owner rank are contiguous. Three
``all_to_all_single`` calls (gloo on CPU, NCCL on GPU): per-expert counts (so a receiver
knows which of its experts each row is for without sending ids), the rows, and the computed
rows back in the order they were sent. Every rank calls it once per MoE layer per step, with
zero rows when it has none. Time spent in the collectives and in the expert GEMMs and bytes
moved are accumulated in :data:`STATS` (benchmarks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from kvserve.engine.parallel.state import ExpertParallelGroup


@dataclass
class DispatchStats:
    calls: int = 0
    dispatch_s: float = 0.0  # counts + rows out
    combine_s: float = 0.0  # computed rows back
    compute_s: float = 0.0  # local expert GEMMs (incl. regrouping)
    bytes_sent: int = 0  # rows to other ranks, both directions
    bytes_received: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


STATS = DispatchStats()


class AllToAllDispatcher:
    def __init__(self, ep: ExpertParallelGroup, num_experts: int) -> None:
        self.ep = ep
        self.world = ep.world_size
        self.per_rank = num_experts // self.world
        ep.expert_range(num_experts)  # validates the split

    def __call__(
        self,
        rows: torch.Tensor,
        expert_counts: torch.Tensor,
        compute: Callable[[torch.Tensor, list[int]], torch.Tensor],
    ) -> torch.Tensor:
        """``rows`` ``[M, H]`` sorted by expert, ``expert_counts`` ``[E]`` -> the experts'
        outputs for ``rows``, same order. ``compute(rows, counts)`` runs local experts."""
        group, n, per = self.ep.group, self.world, self.per_rank
        t0 = time.perf_counter()
        send_expert = expert_counts.to(torch.int64).view(n, per).contiguous()
        recv_expert = torch.empty_like(send_expert)
        dist.all_to_all_single(recv_expert, send_expert, group=group)
        send_counts = send_expert.sum(1).tolist()
        recv_per_src = recv_expert.sum(1).tolist()
        recv = rows.new_empty((sum(recv_per_src), rows.shape[1]))
        dist.all_to_all_single(recv, rows, recv_per_src, send_counts, group=group)
        t1 = time.perf_counter()
        # Received: per source rank, rows sorted by expert; regroup by local expert.
        local_ids = torch.arange(per, device=rows.device).repeat(n)
        local_ids = torch.repeat_interleave(local_ids, recv_expert.view(-1).to(rows.device))
        perm = torch.argsort(local_ids, stable=True)
        out_sorted = compute(recv.index_select(0, perm), recv_expert.sum(0).tolist())
        out = torch.empty_like(recv)
        out[perm] = out_sorted
        t2 = time.perf_counter()
        back = rows.new_empty(rows.shape)
        dist.all_to_all_single(back, out, send_counts, recv_per_src, group=group)
        t3 = time.perf_counter()
        row_bytes = rows.shape[1] * rows.element_size()
        me = self.ep.rank
        remote_sent = sum(send_counts) - send_counts[me] + sum(recv_per_src) - recv_per_src[me]
        STATS.calls += 1
        STATS.dispatch_s += t1 - t0
        STATS.compute_s += t2 - t1
        STATS.combine_s += t3 - t2
        STATS.bytes_sent += remote_sent * row_bytes
        STATS.bytes_received += remote_sent * row_bytes
        return back
