"""Shared fixtures: deterministic tiny model directories, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # The suite shares 2 cores with other processes: oversubscribed intra-op threads make
    # small GEMMs 10-40x slower, so tests run torch single-threaded.
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` preset (Llama, llama3 RoPE scaling, GQA) as a HF-format directory."""
    from kvserve.model.presets import make_model

    return make_model(tmp_path_factory.mktemp("tiny"), preset="tiny")


@pytest.fixture(scope="session")
def tiny_qwen2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny-qwen2`` preset (q/k/v bias, tied embeddings)."""
    from kvserve.model.presets import make_model

    return make_model(tmp_path_factory.mktemp("tiny_qwen2"), preset="tiny-qwen2")


class RunnerDriver:
    """Plays the scheduler for runner tests: allocates block ids from a free list (shuffled,
    so block tables are not contiguous), builds SchedulerOutputs, applies sampled tokens.
    Models with several KV cache groups get a table per group (``group_tables``; every
    block kept), ``tables`` being group 0's."""

    def __init__(self, runner, num_blocks: int = 512, seed: int = 0) -> None:
        import random

        self.runner = runner
        runner.allocate_kv_cache(num_blocks)
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.num_groups = len(getattr(runner, "kv_cache_groups", ())) or 1
        self.group_tables: dict[str, list[list[int]]] = {}

    def step(self, work, finished=()):
        """``work``: [(request, num_tokens)]. Returns the ModelRunnerOutput."""
        from kvserve.engine.outputs import SchedulerOutput

        bs = self.runner.block_size
        so = SchedulerOutput(finished_req_ids=set(finished))
        for req, n in work:
            tables = self.group_tables.setdefault(
                req.request_id, [[] for _ in range(self.num_groups)]
            )
            for table in tables:
                while len(table) * bs < req.num_computed_tokens + n:
                    table.append(self.free.pop())
            so.scheduled.append(req)
            so.num_scheduled_tokens[req.request_id] = n
            so.block_ids[req.request_id] = list(tables[0])
            if self.num_groups > 1:
                so.group_block_ids[req.request_id] = [list(t) for t in tables]
            so.total_num_scheduled_tokens += n
        out = self.runner.execute_model(so)
        for req, n in work:
            req.num_computed_tokens += n
            for tok in out.sampled_token_ids[req.request_id]:
                req.append_output_token(tok)
        return out

    @property
    def tables(self) -> dict[str, list[int]]:
        """Group 0's table of each request."""
        return {rid: tables[0] for rid, tables in self.group_tables.items()}

    def release(self, req) -> None:
        for table in self.group_tables.pop(req.request_id, []):
            self.free.extend(table)

    def generate(self, reqs, max_tokens: int, chunk: int = 1 << 30) -> list[list[int]]:
        """Run ``reqs`` together (chunked prefill of ``chunk`` tokens) to ``max_tokens``."""
        while any(r.num_output_tokens < max_tokens for r in reqs):
            work = [
                (r, min(chunk, r.num_tokens - r.num_computed_tokens))
                for r in reqs
                if r.num_output_tokens < max_tokens
            ]
            self.step(work)
        for r in reqs:
            self.release(r)
        return [list(r.output_token_ids) for r in reqs]


@pytest.fixture
def runner_driver():
    """Factory: ``runner_driver(runner, num_blocks=512)`` -> :class:`RunnerDriver`."""
    return RunnerDriver
