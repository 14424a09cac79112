"""kvserve.sim."""
