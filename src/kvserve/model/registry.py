"""Model class by architecture: the dense Llama-family module, Gemma 3 or the MoE decoder."""

from __future__ import annotations

from torch import nn

from kvserve.model.config import MOE_ARCHITECTURES, ModelConfig


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    if config.architecture in MOE_ARCHITECTURES:
        from kvserve.model.moe_decoder import MoeForCausalLM

        return MoeForCausalLM
    if config.architecture == "Gemma3ForCausalLM":
        from kvserve.model.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    from kvserve.model.llama import LlamaForCausalLM

    return LlamaForCausalLM
