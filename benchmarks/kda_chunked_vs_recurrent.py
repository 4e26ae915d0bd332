"""KDA prefill: the chunked XLA path against the token-by-token scan, side by side.

    python -m benchmarks.kda_chunked_vs_recurrent

B=1, fp32, K3's bounded gate, q and k normalised in the op (as the model calls it). Both functions are
jitted and warmed up; the runs alternate between them so that both see the same machine load, and each
figure is the median of REPEATS runs. The shapes: the embedded k3-tiny's KDA heads (8 x 16) at a
serving prefill's lengths, the issue's (4 x 64), and K3's heads per rank at TP8 (12 x 128). `auto` is
the form chunk_kda's impl="auto" takes on CPU, by the states' size (pallas_kernels.kda.api.SCAN_STATE_VALUES).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import report
from benchmarks.timing import median_us
from pallas_kernels.kda import api, chunk_kda, fused_recurrent_kda

REPEATS = 7
# (heads, head dim, lengths): k3-tiny's, the issue's, then K3's KDA heads per rank at TP8 (96 / 8, 128)
SHAPES = ((8, 16, (16, 64, 256, 1024)), (4, 64, (64, 512, 2048, 8192)), (12, 128, (64, 256, 2048, 8192)))


def inputs(t: int, heads: int, dim: int):
    rng = np.random.default_rng(0)
    shape = (1, t, heads, dim)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    g = jnp.asarray(-5.0 / (1.0 + np.exp(-rng.standard_normal(shape))), jnp.float32)  # K3's gate, in (-5, 0)
    beta = jnp.asarray(rng.uniform(0, 1, shape[:3]), jnp.float32)
    return q, k, v, g, beta



def main() -> None:
    options = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, impl="xla")
    chunked = jax.jit(lambda *a: chunk_kda(*a, **options))
    recurrent = jax.jit(lambda *a: fused_recurrent_kda(*a, **options))
    rows = []
    for heads, dim, t in ((h, d, t) for h, d, lengths in SHAPES for t in lengths):
        args = inputs(t, heads, dim)
        o_c, s_c = chunked(*args)
        o_r, s_r = recurrent(*args)
        assert np.allclose(o_c, o_r, atol=1e-4) and np.allclose(s_c, s_r, atol=1e-4), "the paths disagree"
        chunked_ms, recurrent_ms = (t / 1e3 for t in median_us([chunked, recurrent], args, REPEATS))
        scan = api.auto_runs_scan(args[0], args[2])  # q, v
        rows.append({"H": heads, "K=V": dim, "T": t, "chunked_ms": chunked_ms, "recurrent_ms": recurrent_ms,
                     "speedup": recurrent_ms / chunked_ms, "auto": "scan" if scan else "chunked"})
    report("kda_chunked_vs_recurrent", rows,
           note=f"B=1 fp32, median of {REPEATS}, {jax.default_backend()}; speedup = recurrent / chunked")


if __name__ == "__main__":
    main()
