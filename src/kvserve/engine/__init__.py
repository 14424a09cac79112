"""kvserve.engine."""
