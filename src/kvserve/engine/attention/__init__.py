"""kvserve.engine.attention."""
