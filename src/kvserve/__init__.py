"""kvserve: a KV-cache-centric LLM serving system."""

import os

# OpenMP threads waiting at a barrier sleep instead of spinning (libgomp, read once when torch
# loads, so only when kvserve is imported first; OMP_WAIT_POLICY=ACTIVE restores spinning).
# torch splits every op evenly across its threads: with spinning, a thread that shares its core
# with anything else (the server's own threads, other processes) stalls the whole team at
# every op. On a 2-core box under load, the small preset's bf16 decode step took 20-33 ms
# passive vs 40-250 ms spinning, a 1k-token prefill 1.2-1.4 s vs 4.2-5.1 s (one thread: 15-24
# ms, 1.3-1.5 s); see engine/model_runner.configure_threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that light consumers (the router importing hashing) never import torch.
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
