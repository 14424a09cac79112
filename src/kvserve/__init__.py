"""kvserve: a KV-cache-centric LLM serving system."""

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
