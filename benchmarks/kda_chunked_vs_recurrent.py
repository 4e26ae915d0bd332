"""KDA on this machine: the chunked XLA path vs the token-by-token scan, side by side.

    python -m benchmarks.kda_chunked_vs_recurrent
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import report
from pallas_kernels.kda import chunk_kda, fused_recurrent_kda

HEADS, DIM, REPEATS = 4, 64, 5


def median_seconds(fn, *args) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def inputs(t: int):
    rng = np.random.default_rng(0)
    shape = (1, t, HEADS, DIM)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    g = jnp.asarray(-5.0 / (1 + np.exp(-rng.standard_normal(shape))), jnp.float32)  # K3's bounded gate
    beta = jnp.asarray(rng.uniform(0, 1, shape[:3]), jnp.float32)
    return q, k, v, g, beta


def main() -> None:
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    chunked = jax.jit(lambda *a: chunk_kda(*a, **kw))
    recurrent = jax.jit(lambda *a: fused_recurrent_kda(*a, **kw))
    rows = []
    for t in (512, 2048, 8192):
        args = inputs(t)
        c, r = median_seconds(chunked, *args), median_seconds(recurrent, *args)
        rows.append({"T": t, "chunked_ms": 1e3 * c, "recurrent_ms": 1e3 * r, "speedup": r / c})
    report("kda_chunked_vs_recurrent", rows, note=f"B=1 H={HEADS} K=V={DIM} fp32, median of {REPEATS}, "
                                                  f"{jax.default_backend()}")


if __name__ == "__main__":
    main()
