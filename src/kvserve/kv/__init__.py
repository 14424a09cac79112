"""kvserve.kv."""
