"""When each request (or conversation) is sent: offsets in seconds from the start of a run.

Poisson arrivals at ``rate`` are the usual open-loop load; ``burstiness`` reshapes the gaps as a
gamma distribution with the same mean (1: Poisson, < 1: burstier, > 1: more regular), as
vLLM's benchmark does. ``bursts`` sends groups of ``burst_size`` at once, with exponential gaps
between groups so the mean rate is still ``rate``. An infinite rate sends everything at once.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, *, seed: int, mode: str = "poisson", burstiness: float = 1.0,
                  burst_size: int = 8) -> list[float]:
    """Offsets of ``n`` arrivals, the first at 0, in increasing order."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    if mode == "poisson":
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
        return [0.0, *np.cumsum(gaps).tolist()]
    if mode == "bursts":
        groups = math.ceil(n / burst_size)
        gaps = rng.exponential(scale=burst_size / rate, size=groups - 1)
        starts = [0.0, *np.cumsum(gaps).tolist()]
        return [starts[i // burst_size] for i in range(n)]
    raise ValueError(f"unknown arrival mode {mode!r}: poisson or bursts")
