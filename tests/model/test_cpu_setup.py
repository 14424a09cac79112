"""CPU setup decided once per process: torch threads (one core left to the server, lent back
for heavy steps) and the OpenMP wait policy kvserve sets before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from kvserve.cpu import usable_cores
from kvserve.engine.llm import LLM
from kvserve.engine.model_runner import configure_threads, heavy_step_min_tokens, heavy_step_threads
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import load_model

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


def test_heavy_step_threads_default_lends_the_reserved_core_unless_pinned():
    cores = usable_cores()
    assert heavy_step_threads(None, 1, cores, False, CPU) == cores  # torch's default: every core
    assert heavy_step_threads(None, 1, 1, False, CPU) == 1  # a test session's 1 stays 1
    assert heavy_step_threads(None, 1, cores, True, CPU) == 1  # --num-threads pins both
    assert heavy_step_threads(3, 1, cores, True, CPU) == 3  # explicit wins
    assert heavy_step_threads(None, 2, 64, False, torch.device("cuda")) == 2  # GPU: untouched


def test_heavy_step_threshold_follows_the_model_size(tiny_model_dir):
    """The default heavy step: the tokens whose projections take HEAVY_STEP_GFLOP (tiny:
    ~2.9M projection weights, so a few hundred tokens), a tenth of them for a tenth of it."""
    tiny = load_model(str(tiny_model_dir))
    n = heavy_step_min_tokens(tiny)
    assert 200 < n < 500
    assert abs(heavy_step_min_tokens(tiny, gflop=0.2) - n / 10) <= 1


def test_heavy_steps_run_with_heavy_step_threads_and_outputs_do_not_change(tiny_model_dir):
    """A step of at least ``heavy_step_min_tokens`` tokens runs its forward pass on
    ``heavy_step_threads`` threads, a decode step on ``num_threads``; greedy outputs equal a
    run on one thread throughout."""
    before = torch.get_num_threads()
    prompt = {"prompt_token_ids": list(range(5, 45))}  # 40 tokens: one prefill step
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        llm = LLM(str(tiny_model_dir), dtype="float32", num_threads=1, heavy_step_threads=2,
                  heavy_step_min_tokens=32)  # fmt: skip
        seen: list[tuple[int, int]] = []  # (tokens in the step, torch threads in its forward)
        llm.engine.runner.model.register_forward_pre_hook(
            lambda _m, args: seen.append((args[0].numel(), torch.get_num_threads()))
        )
        heavy = llm.generate(prompt, params)[0].outputs[0].token_ids
        assert seen == [(40, 2), (1, 1), (1, 1), (1, 1)]
        llm.shutdown()
        llm = LLM(str(tiny_model_dir), dtype="float32", num_threads=1, heavy_step_threads=1)
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == heavy
        llm.shutdown()
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
