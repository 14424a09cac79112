"""CPU setup decided once per process: torch threads (one core left to the server) and the
OpenMP wait policy kvserve sets before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from kvserve.engine.model_runner import configure_threads, usable_cores

CPU = torch.device("cpu")


def test_threads_default_leaves_a_core_and_never_raises():
    before = torch.get_num_threads()
    try:
        cores = usable_cores()
        torch.set_num_threads(cores)
        want = cores - 1 if cores >= 2 else cores
        assert configure_threads(None, CPU) == want == torch.get_num_threads()
        torch.set_num_threads(1)  # a count chosen earlier (here: the test session's) is kept
        assert configure_threads(None, CPU) == 1 == torch.get_num_threads()
        assert configure_threads(3, CPU) == 3 == torch.get_num_threads()  # explicit wins
    finally:
        torch.set_num_threads(before)


def test_omp_wait_policy_passive_unless_set():
    code = "import kvserve, os; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "ACTIVE"
