"""engine/cpu_malloc.py: after keep_activations_in_heap(), large blocks freed by a step are
reused by the next one without page faults (no mmap, no trim, one arena).

Each case runs in a fresh interpreter: mallopt settings are process-wide and an arena, once
created, stays. The child allocates like a CPU step's activations in a thread other than the
main one (the engine thread): two 40 MiB blocks and a small one, written, freed, four rounds,
and counts the minor page faults of each round with ``getrusage(RUSAGE_THREAD)``. With glibc's
defaults every round faults every page in again (the blocks are mmapped and unmapped); without
one arena, a thread arena's second heap is unmapped when freed; without the trim threshold,
the heap top goes back to the kernel.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt settings apply to glibc on Linux only",
)

MIB = 1 << 20
SIZES = (40 * MIB, 40 * MIB, 3 * MIB)
PAGES = sum(SIZES) // os.sysconf("SC_PAGE_SIZE")

CHILD = """
import ctypes, ctypes.util, json, resource, sys, threading

from kvserve.engine.cpu_malloc import keep_activations_in_heap

applied = keep_activations_in_heap()
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
sizes = json.loads(sys.argv[1])
faults = []

def step_rounds():
    for _ in range(4):
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = []
        for n in sizes:
            p = libc.malloc(n)
            assert p
            ctypes.memset(p, 1, n)
            blocks.append(p)
        for p in blocks:
            libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)

t = threading.Thread(target=step_rounds)
t.start()
t.join()
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _run_child(tune: bool) -> dict:
    env = dict(os.environ)
    env["KVSERVE_MALLOC_TUNE"] = "1" if tune else "0"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(SIZES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_activations_are_reused_without_page_faults() -> None:
    res = _run_child(tune=True)
    assert res["applied"] is True
    first, *reused = res["faults"]
    assert first > PAGES // 2  # the first round faults its pages in: the count works
    # Later rounds reuse the same heap memory: (next to) no faults.
    assert max(reused) < PAGES // 50, res["faults"]


def test_glibc_defaults_fault_every_round_in_again() -> None:
    """The same child with the settings off (``KVSERVE_MALLOC_TUNE=0``): every round faults
    its pages in again, so the test above measures what the settings change."""
    res = _run_child(tune=False)
    assert res["applied"] is False
    assert min(res["faults"][1:]) > PAGES // 2, res["faults"]
