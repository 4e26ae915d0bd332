"""KDA on a GPU: the Pallas-Triton kernels against the XLA path at K3's per-device shapes.

    python -m benchmarks.gpu_check_kda

Prefill: chunk_kda, B = 1, T = 8192 and 32768, H = 12 heads of K = V = 128 (K3 at TP8), bf16 q, k,
v, fp32 gate (K3's, in (-5, 0)) and beta, q and k normalised in the op, as the model calls it.
Decode: fused_recurrent_kda, 64 sequences of one token each with an fp32 state.

Each kernel is checked against the XLA path (which computes with fp32 products) before it is
timed: median of REPEATS runs after a warm-up, the two paths interleaved.

FLOPs of the chunked form are those the kernels do, per chunk of C = 64 tokens and head, counting
a multiply-add as 2 and nothing for exps, masks or the in-block forward substitution:
  scores Akk and Aqk on the 10 lower 16 x 16 blocks:   2 * 10 * 2 * 16 * 16 * K
  the 16 x 16 tiles of (I + Akk)^-1:                   16 * 2 * 16 * 16 * 16
  u and w from those tiles:                           10 * 2 * 16 * 16 * (K + V)
  state passing (w S, (q e^G) S, k^T v'):             6 * C * K * V
  Aqk v' on the 10 lower blocks:                      10 * 2 * 16 * 16 * V
about 152K per token and head at K = V = 128. The issue's target is fla's Triton chunk_kda throughput on
the same shapes; fla is not on the GPU machine, so compare its TFLOP/s (measured elsewhere with this
FLOP count) by hand. Decode is memory bound: its TB/s counts reading and writing each fp32 state.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import report
from benchmarks.timing import median_us, relative_error
from pallas_kernels.kda import chunk_kda, fused_recurrent_kda

REPEATS = 7
HEADS, DIM, CHUNK = 12, 128, 64
PREFILL_LENGTHS = (8192, 32768)
DECODE_BATCH = 64
PEAK_TFLOPS, PEAK_TBPS = 990.0, 4.8  # H200: dense bf16, HBM


def inputs(batch: int, t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (batch, t, HEADS, DIM)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    g = jnp.asarray(-5.0 / (1.0 + np.exp(-rng.standard_normal(shape))), jnp.float32)  # K3's gate
    beta = jnp.asarray(rng.uniform(0, 1, shape[:3]), jnp.float32)
    state = jnp.asarray(0.1 * rng.standard_normal((batch, HEADS, DIM, DIM)), jnp.float32)
    return q, k, v, g, beta, state


def chunk_flops(t: int) -> float:
    per_chunk = (2 * 10 * 2 * 16 * 16 * DIM + 16 * 2 * 16 ** 3 + 10 * 2 * 16 * 16 * 2 * DIM
                 + 6 * CHUNK * DIM * DIM + 10 * 2 * 16 * 16 * DIM)
    return float(per_chunk * -(-t // CHUNK) * HEADS)




def compare(op, impls, args, o_tolerance):
    """Runs op with each impl on args = (q, k, v, g, beta, state); checks the first against the
    second; returns (times in us, o error, state error)."""
    fns = [jax.jit(lambda q, k, v, g, beta, s, impl=impl: op(q, k, v, g, beta, initial_state=s, impl=impl,
                                                              output_final_state=True, use_qk_l2norm_in_kernel=True))
           for impl in impls]
    (o, s), (ref_o, ref_s) = (fn(*args) for fn in fns)
    # o is bf16 (2^-8 of the largest value) and the kernel's products keep about 16 bits; the fp32
    # state accumulates those over the whole sequence, hence the looser state bound.
    o_err, s_err = relative_error(o, ref_o), relative_error(s, ref_s)
    assert o_err < o_tolerance and s_err < 1e-3, f"{op.__name__}: o error {o_err:.2e}, state error {s_err:.2e}"
    return median_us(fns, args, REPEATS), o_err, s_err


def interpret_check() -> None:
    """Off a GPU: the kernels in interpret mode against the reference on a small shape."""
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, 70, 2, 32)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 70, 2, 32)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0, 1, (1, 70, 2, 32)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (1, 70, 2)), jnp.float32)
    for op in (chunk_kda, fused_recurrent_kda):
        options = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
        (o, s), (ref_o, ref_s) = (op(q, k, v, g, beta, impl=impl, **options) for impl in ("pallas", "reference"))
        errors = relative_error(o, ref_o), relative_error(s, ref_s)
        assert max(errors) < 1e-5, f"{op.__name__}: interpret-mode errors {errors}"
        print(f"{op.__name__}: interpret mode matches the reference (errors {errors[0]:.1e}, {errors[1]:.1e})")


def main() -> None:
    if jax.default_backend() != "gpu":
        print(f"gpu_check_kda needs a GPU (backend: {jax.default_backend()}); running the interpret-mode check only")
        interpret_check()
        return
    rows = []
    for t in PREFILL_LENGTHS:
        (pallas_us, xla_us), o_err, s_err = compare(chunk_kda, ("pallas", "xla"), inputs(1, t), o_tolerance=1e-2)
        rows.append({"op": "chunk_kda", "B": 1, "T": t, "pallas_us": pallas_us, "xla_us": xla_us,
                     "pallas/xla": pallas_us / xla_us, "pallas_rate": chunk_flops(t) / pallas_us / 1e6,
                     "unit": "TFLOP/s", "frac_peak": chunk_flops(t) / pallas_us / 1e6 / PEAK_TFLOPS,
                     "o_err": o_err, "state_err": s_err})
    (pallas_us, xla_us), o_err, s_err = compare(fused_recurrent_kda, ("pallas", "xla"), inputs(DECODE_BATCH, 1),
                                                o_tolerance=1e-2)
    state_bytes = 2 * DECODE_BATCH * HEADS * DIM * DIM * 4  # read and written once, fp32
    rows.append({"op": "fused_recurrent_kda", "B": DECODE_BATCH, "T": 1, "pallas_us": pallas_us, "xla_us": xla_us,
                 "pallas/xla": pallas_us / xla_us, "pallas_rate": state_bytes / pallas_us / 1e6, "unit": "TB/s",
                 "frac_peak": state_bytes / pallas_us / 1e6 / PEAK_TBPS, "o_err": o_err, "state_err": s_err})
    report("gpu_check_kda", rows,
           note=f"H={HEADS} K=V={DIM} bf16 in, fp32 state, median of {REPEATS}; frac_peak of "
                f"{PEAK_TFLOPS:.0f} TFLOP/s (prefill) or {PEAK_TBPS} TB/s (decode); fla chunk_kda: compare by hand")


if __name__ == "__main__":
    main()
