"""Request send times for the serving benchmark: Poisson or Gamma arrivals, or one burst.

Pure numpy, deterministic for a seed. As in vLLM's benchmark_serving.py, the gaps between
requests are Gamma(shape=burstiness, scale=1 / (rate * burstiness)): the mean rate is
`request_rate` whatever the burstiness; burstiness 1 is a Poisson process, below 1 burstier
(more clumped) traffic, above 1 more evenly spaced. A rate of inf sends everything at t=0.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """Send offsets in seconds from the start, non-decreasing, the first at 0.  # [N]"""
    if num_requests < 0:
        raise ValueError(f"num_requests={num_requests} is invalid: must be >= 0")
    if not request_rate > 0:
        raise ValueError(f"request_rate={request_rate} is invalid: must be > 0 (or inf)")
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness={burstiness} is invalid: must be a finite number > 0")
    if math.isinf(request_rate) or num_requests == 0:
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                     size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
