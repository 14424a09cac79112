"""kvserve.server."""
