"""kvserve.bench.ports: ports for the servers tests and benchmarks start are below the kernel's
ephemeral range (where outgoing connections' source ports come from), free, and never the
same twice in one process."""

from __future__ import annotations

import socket

from kvserve.bench.ports import LOWEST_PORT, ephemeral_low, free_port, free_port_block


def test_ports_are_below_the_ephemeral_range_and_never_repeat() -> None:
    low = ephemeral_low()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST_PORT <= p < low for p in ports), (low, sorted(ports)[-5:])


def test_a_block_is_consecutive_listenable_ports_not_handed_out_before() -> None:
    taken = {free_port() for _ in range(50)}
    base = free_port_block("127.0.0.1", 4)
    block = range(base, base + 4)
    assert base + 4 <= ephemeral_low()
    assert not taken.intersection(block)
    socks = []
    try:
        for port in block:  # every port of it can be listened on
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
            s.listen(1)
    finally:
        for s in socks:
            s.close()
