"""Paged attention backends and the per-step metadata they consume.

KV cache layout (shared by runner, attention and offloading): one tensor
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; block 0 is the null block.
"""

from kvserve.engine.attention.metadata import AttentionMetadata, PrefillInfo
from kvserve.engine.attention.torch_backend import TorchAttentionBackend


def get_attention_backend(device: str = "cpu") -> TorchAttentionBackend:
    """The backend for ``device`` (torch ops serve both CPU and CUDA)."""
    return TorchAttentionBackend()


__all__ = ["AttentionMetadata", "PrefillInfo", "TorchAttentionBackend", "get_attention_backend"]
