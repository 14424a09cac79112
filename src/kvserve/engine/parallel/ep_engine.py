"""An engine rank of an expert-parallel group: it steps in lockstep with the other ranks.

Every MoE layer of a forward pass is a collective across the ranks, so a rank must run a
forward whenever any rank does. Each step starts with one ``all_reduce(MAX)`` of "I have
unfinished requests" (the data-parallel coordination, decided by all ranks together): when
no rank has work, every rank skips the step (and backs off a little, so an idle group
costs one small collective per few milliseconds); when some rank has work, ranks with work
step normally and ranks without (or whose scheduler found nothing to run, e.g. waiting for
KV) run a dummy step: every MoE layer's dispatch and combine with zero tokens.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.parallel.state import ExpertParallelGroup

# Backoff while the whole group is idle: first sleep, growth factor, cap (seconds).
IDLE_SLEEP_MIN_S = 0.0005
IDLE_SLEEP_MAX_S = 0.01


class ExpertParallelEngine(LLMEngine):
    def __init__(self, config: EngineConfig, group: ExpertParallelGroup) -> None:
        super().__init__(config)
        self.group = group
        if not hasattr(self.runner.model, "dummy_moe_step"):
            raise ValueError("expert parallelism needs a mixture-of-experts model")
        device = self.runner.device if dist.get_backend() == "nccl" else torch.device("cpu")
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._ran_forward = False
        self._idle_sleep = IDLE_SLEEP_MIN_S
        self.num_dummy_steps = 0
        self.num_idle_polls = 0
        runner_execute = self.runner.execute_model

        def execute_model(scheduler_output):  # marks that this step joined the collectives
            self._ran_forward = True
            return runner_execute(scheduler_output)

        self.runner.execute_model = execute_model

    def has_local_work(self) -> bool:
        return super().has_unfinished_requests()

    def has_unfinished_requests(self) -> bool:
        # The engine thread must keep stepping: other ranks may need this one's collectives.
        return True

    def step(self) -> list[RequestOutput]:
        local = self.has_local_work()
        self._flag.fill_(1 if local else 0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group.group)
        if not int(self._flag.item()):
            self.num_idle_polls += 1
            time.sleep(self._idle_sleep)
            self._idle_sleep = min(self._idle_sleep * 2, IDLE_SLEEP_MAX_S)
            return []
        self._idle_sleep = IDLE_SLEEP_MIN_S
        self._ran_forward = False
        outputs = super().step() if local else []
        if not self._ran_forward:
            self.num_dummy_steps += 1
            self.runner.model.dummy_moe_step()
        return outputs
