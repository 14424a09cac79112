"""Arrival processes of open-loop benchmarks: when each session's first request is sent."""

from __future__ import annotations

import math
import random


def arrival_times(
    n: int, request_rate: float, *, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """``n`` send times (seconds from start) of a Poisson process at ``request_rate`` per second.

    ``burstiness`` is the shape of the gamma-distributed gaps (1.0: Poisson; < 1: burstier;
    > 1: more regular), with the mean gap kept at ``1 / request_rate``, as vLLM's benchmark
    does. An infinite rate sends everything at time 0.
    """
    if request_rate <= 0:
        raise ValueError("request_rate must be > 0")
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(f"arrivals:{seed}")
    theta = 1.0 / (request_rate * burstiness)
    t = 0.0
    out = []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out
