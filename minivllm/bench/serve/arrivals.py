"""When each request of an open-loop run is sent (vLLM 0.32: ``get_request`` in ``vllm/benchmarks/serve.py``).

The gaps between arrivals are independent draws from a gamma distribution with shape ``burstiness`` and mean
``1 / request_rate``: ``burstiness = 1`` is the exponential distribution, i.e. a Poisson process of rate
``request_rate``; below 1 arrivals come in bursts, above 1 more evenly. ``request_rate = inf`` sends everything at
once. Both draw all the gaps up front. Where minivllm differs from vLLM: its gaps come from its own
``numpy.random.default_rng(seed)`` (vLLM's from the global ``np.random``), so one seed gives the same schedule on
every machine and to every server of a comparison; the first request is sent at time 0 (vLLM waits one gap before
it too); and the times are not rescaled (vLLM stretches them so that the last send is at exactly
``num_requests / request_rate``, which steadies throughput across seeds).
"""

from __future__ import annotations

import math
from typing import List

import numpy as np


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> List[float]:
    """Send times in seconds from the start of the run, non-decreasing, the first one 0.0.

    Args:
        num_requests: how many requests (>= 1).
        request_rate: mean requests per second (> 0; ``math.inf``: all at time 0).
        burstiness: gamma shape of the gaps (> 0; 1 = Poisson).
        seed: seed of ``numpy.random.default_rng``.

    Raises:
        ValueError: for ``num_requests < 1``, ``request_rate <= 0`` or ``burstiness <= 0`` (or NaN).
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s (inf: all at once), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0 (1 = Poisson arrivals), got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()
