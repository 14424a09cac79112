"""Loopback ports for the servers this process starts (local clusters, benchmarks, tests).

A port from ``bind(0)`` comes from the kernel's ephemeral range, the one outgoing connections
draw their source ports from: a server started on it seconds later can find it taken ("Address
already in use"; a fresh-clone CI run lost a dozen tests that way). Ports here are drawn at
random below that range, checked bindable, and never handed out twice in one process.
"""

from __future__ import annotations

import random
import socket

LOWEST_PORT = 10000

_handed_out: set[int] = set()
_rng = random.Random()  # its own state: tests that seed the global one do not repeat ports


def ephemeral_low() -> int:
    """First port of the kernel's ephemeral range (outgoing connections' source ports)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(host: str, n: int, attempts: int = 500) -> int:
    """A base port with ``n`` consecutive ports free to listen on, below the ephemeral range,
    none handed out before by this process. Should that range be full, the kernel's pick."""
    low, high = LOWEST_PORT, ephemeral_low() - n
    for _ in range(attempts):
        base = _rng.randrange(low, high) if high > low else 0
        ports = range(base, base + n)
        if base and not _handed_out.intersection(ports) and all(_bindable(host, p) for p in ports):
            _handed_out.update(ports)
            return base
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        ports = range(base, base + n)
        if base + n <= 65536 and all(_bindable(host, p) for p in ports):
            _handed_out.update(ports)
            return base
    raise RuntimeError(f"no block of {n} free ports on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free to listen on (see :func:`free_port_block`)."""
    return free_port_block(host, 1)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
