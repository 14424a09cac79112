"""The expert-parallel group of this process (one per rank process, set before the model is
built) and the expert placement it implies: rank ``r`` of ``N`` owns experts
``[r*E/N, (r+1)*E/N)``. Without a group every expert is local."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ExpertParallelGroup:
    rank: int
    world_size: int
    group: Any = None  # torch.distributed ProcessGroup (None: the default group)

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """``[start, end)`` of the experts this rank owns."""
        if num_experts % self.world_size:
            raise ValueError(
                f"{num_experts} experts do not split evenly over {self.world_size} ranks"
            )
        per = num_experts // self.world_size
        return self.rank * per, (self.rank + 1) * per


_EP_GROUP: ExpertParallelGroup | None = None


def set_expert_parallel_group(group: ExpertParallelGroup | None) -> None:
    global _EP_GROUP
    _EP_GROUP = group


def get_expert_parallel_group() -> ExpertParallelGroup | None:
    return _EP_GROUP
