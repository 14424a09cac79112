"""kvserve.kv.backends."""
