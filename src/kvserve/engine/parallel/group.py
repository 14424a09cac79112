"""The torch.distributed process group of an expert-parallel server's ranks.

One process per data-parallel rank joins a group of ``data_parallel_size`` over a TCP
rendezvous on loopback (gloo on CPU, NCCL on CUDA, each rank on GPU ``rank % count``), and
publishes it as this process's :class:`ExpertParallelGroup` before the model is built, so
MoE layers shard their experts and dispatch through it.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from kvserve.engine.parallel.state import ExpertParallelGroup, set_expert_parallel_group

logger = logging.getLogger(__name__)

# A collective that waits this long has a peer that is alive but stuck: fail rather than hang.
# (A peer that dies breaks its sockets at once, and the supervisor stops the group.)
COLLECTIVE_TIMEOUT_S = 300.0


def init_expert_parallel(
    rank: int,
    world_size: int,
    master_port: int,
    *,
    backend: str = "auto",
    device: str = "auto",
    master_addr: str = "127.0.0.1",
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> ExpertParallelGroup:
    """Join the group (blocks until every rank has joined) and make it current."""
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if backend == "auto":
        backend = "nccl" if on_cuda else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"data-parallel backend must be gloo or nccl, got {backend!r}")
    if on_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    group = ExpertParallelGroup(rank=rank, world_size=world_size, group=None)
    set_expert_parallel_group(group)
    logger.info("expert-parallel rank %d/%d joined (%s)", rank, world_size, backend)
    return group


def destroy_expert_parallel() -> None:
    set_expert_parallel_group(None)
    if dist.is_initialized():
        dist.destroy_process_group()
