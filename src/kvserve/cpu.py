"""The CPUs this process may run on: one answer for the engine's torch threads, the storage
tiers' read threads and the data-parallel supervisor's split of cores between ranks (torch-free,
so the supervisor does not load torch to ask)."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """CPUs in this process's affinity mask (cgroup CPU quotas are not read)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
