"""The Valkey/Redis server the tests and benchmarks start: once full, evicting KV-chunk-sized
values, it reuses their memory for the next ones instead of faulting in fresh pages."""

from __future__ import annotations

import os

from kvserve.bench.redis_server import RedisServer

VALUE_BYTES = 512 * 1024  # above glibc's initial mmap threshold (128 KiB), as a KV chunk is
MAXMEMORY = 16 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def minor_faults(pid: int) -> int:
    """The process's minor page faults so far (``/proc/PID/stat`` field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def faults_per_value_after_full(srv: RedisServer) -> float:
    """Fill the server to ``maxmemory``, then count its page faults per value over the next
    ``maxmemory`` of values (each evicting an older one)."""
    client = srv.client()
    value = os.urandom(VALUE_BYTES)
    per_turnover = MAXMEMORY // VALUE_BYTES
    for i in range(per_turnover + 4):  # full, and evicting
        client.set(f"fill:{i}", value)
    assert client.info("stats")["evicted_keys"] > 0
    before = minor_faults(srv.proc.pid)
    for i in range(per_turnover):
        client.set(f"next:{i}", value)
    return (minor_faults(srv.proc.pid) - before) / per_turnover


def test_a_full_server_reuses_evicted_values_memory(redis_server_factory):
    srv = redis_server_factory(maxmemory=MAXMEMORY)
    faults = faults_per_value_after_full(srv)
    # A value in fresh pages costs VALUE_BYTES / PAGE faults (128); reused memory next to none.
    assert faults < VALUE_BYTES / PAGE / 8, f"{faults:.1f} page faults per stored value"


def test_glibc_malloc_defaults_fault_fresh_pages_through_the_first_turnover(
    redis_server_factory,
):
    """Why the launcher sets the tunables: the same server with glibc's defaults faults in
    fresh pages for most values of the first turnover (measured 64-128 faults per 128-page
    value: glibc's dynamic mmap threshold moves at the first free, so a run may land half its
    values in reused heap), against next to none with them (the test above: < 16)."""
    srv = redis_server_factory(maxmemory=MAXMEMORY, reuse_freed_memory=False)
    if not srv.client().info("memory")["mem_allocator"].startswith("libc"):
        return  # another allocator (jemalloc): the glibc tunables do not apply to it
    faults = faults_per_value_after_full(srv)
    assert faults > VALUE_BYTES / PAGE / 4, f"{faults:.1f} page faults per stored value"
