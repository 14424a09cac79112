"""kvserve.kv.offload."""
