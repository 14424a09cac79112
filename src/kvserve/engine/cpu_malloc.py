"""glibc malloc settings for CPU engines: keep step activations in the heap.

torch's CPU allocator has no cache: every intermediate tensor is a ``posix_memalign`` and a
``free``. glibc serves blocks above its mmap threshold (dynamic, at most 32 MiB) with a fresh
``mmap`` and unmaps them on free, and trims the heap top back to the kernel; either way the
next step's tensor of that size page-faults in and the kernel zeroes every page again. An fp32
prefill step of 2048 tokens (``small`` preset) allocates a [2048, 4608] gate/up output (37.7
MB) per layer: 1.38M minor faults and 2.4-2.6 s of system time per 16k prompt tokens, ~15% of
the prefill. Serving engines reuse the same sizes step after step, so the engine keeps them:
no mmap for allocations (``M_MMAP_MAX`` 0), no heap trimming (``M_TRIM_THRESHOLD``) and one
arena (``M_ARENA_MAX`` 1: a thread arena's heaps are at most 64 MiB and are unmapped when
empty, so the engine thread of a server faulted in 0.5M pages per 16k fp32 prompt tokens with
the first two alone). The process keeps its peak activation memory: +190-330 MiB RSS for fp32
2048-token steps of the ``small`` preset, flat over steps of varied shapes (vLLM's CPU build
gets the same from tcmalloc when its library is present). A loop of odd-sized aligned blocks
with small allocations between them can fragment the heap (it grows instead of reusing them):
the engine's repeated step shapes reuse them. The arena limit only holds for threads that
first allocate after it is set: the runner sets it before the engine thread starts.

``KVSERVE_MALLOC_TUNE=0`` leaves glibc's defaults (for A/B measurements).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

_TRIM_THRESHOLD = 1 << 30  # bytes of free heap top kept before trimming (int: mallopt's type)

_applied: bool | None = None


def keep_activations_in_heap() -> bool:
    """Apply the settings once per process (glibc on Linux only); True when they are in
    effect. Safe to call again: later calls return the first result."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("KVSERVE_MALLOC_TUNE", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in ((M_TRIM_THRESHOLD, _TRIM_THRESHOLD), (M_MMAP_MAX, 0), (M_ARENA_MAX, 1))
    )
    if not ok:
        logger.warning("mallopt failed: CPU activations stay on glibc's mmap defaults")
    _applied = ok
    return ok
