"""Side-by-side timing and error helpers shared by the benchmarks."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_us(fns, args, repeats: int = 7) -> list[float]:
    """Median wall time of each function in microseconds, after a warm-up call, the runs interleaved so
    that a noisy neighbour slows every function alike."""
    for fn in fns:
        jax.block_until_ready(fn(*args))  # compile and warm up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, runs in zip(fns, times):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            runs.append(time.perf_counter() - start)
    return [1e6 * float(np.median(runs)) for runs in times]


def relative_error(actual, expected) -> float:
    """Largest absolute difference over the largest magnitude of `expected`."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))
