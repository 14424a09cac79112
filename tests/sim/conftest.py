"""Fixtures of the simulator tests: simulated engines on the tiny model's tokenizer."""

from __future__ import annotations

from pathlib import Path

from kvserve.sim.instance import SimEngineConfig, build_sim_engine


def sim_engine(model_dir: Path, **overrides):
    """A simulated engine that does not sleep (time_scale 0) unless told otherwise."""
    kwargs = dict(
        model=str(model_dir),
        sim_latency="cpu-tiny",
        sim_time_scale=0.0,
        num_kv_blocks=64,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_kv_cache_events=True,
    )
    kwargs.update(overrides)
    return build_sim_engine(SimEngineConfig(**kwargs))
