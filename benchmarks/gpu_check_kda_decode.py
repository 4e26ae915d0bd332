"""The KDA decode step on a GPU: the Pallas-Triton kernel against the XLA path at K3's per-device shapes.

    python -m benchmarks.gpu_check_kda_decode

12 heads of 128 (K3 at TP8), W = 4, bf16 activations and conv pool, fp32 states in a pool of N + 1
slots (rows on slots 1..N in shuffled order), K3's safe gate, N = 64 and 256 rows, T = 1 (decode)
and 8 (a speculative window). Each path is first checked against the other, then timed over
STEPS chained steps inside one jit with the pools donated (in place, as the engine runs it; no
dispatch cost in the figure): median of REPEATS after a warm-up, the two paths interleaved.

Bytes per step, the least a step must move: the fp32 states read and written, the conv windows read
and written, and the inputs and outputs (qkv, f, beta logits, o; weights are negligible).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import report
from benchmarks.timing import relative_error
from pallas_kernels.kda_decode import kda_decode

HEADS, DIM, WIDTH = 12, 128, 4
ROWS, TOKENS = (64, 256), (1, 8)
GATE = -5.0
STEPS, REPEATS = 20, 7
PEAK_TBPS = 4.8  # H200 HBM


def inputs(n: int, t: int, heads: int = HEADS, dim: int = DIM, seed: int = 0):
    rng = np.random.default_rng(seed)
    p, s = heads * dim, n + 1

    def normal(*shape, scale=1.0, dtype=jnp.float32):
        return jnp.asarray(scale * rng.standard_normal(shape), dtype)

    return (normal(n, t, 3, p, dtype=jnp.bfloat16), normal(WIDTH, 3, p, scale=0.5),
            normal(s, WIDTH - 1, 3, p, dtype=jnp.bfloat16), normal(n, t, p), normal(p), normal(heads),
            normal(n, t, heads, dtype=jnp.bfloat16), normal(s, heads, dim, dim, scale=0.3),
            jnp.asarray(rng.permutation(n) + 1, jnp.int32))


def step_bytes(n: int, t: int) -> int:
    p = HEADS * DIM
    states = 2 * n * HEADS * DIM * DIM * 4
    windows = 2 * n * (WIDTH - 1) * 3 * p * 2
    per_token = n * t * (3 * p * 2 + p * 4 + HEADS * 2 + p * 2)  # qkv, f, beta logits, o
    return states + windows + per_token


def chained(impl: str):
    """STEPS decode steps, each feeding its pools to the next; the pools (arguments 2 and 7) donated."""
    def run(qkv, conv_weight, conv_pool, f, dt_bias, a_log, beta_logits, state_pool, slots):
        def body(_, carry):
            _, conv, state = carry
            return kda_decode(qkv, conv_weight, conv, f, dt_bias, a_log, beta_logits, state, slots,
                              gate_lower_bound=GATE, impl=impl)
        o = jnp.zeros((*qkv.shape[:2], *state_pool.shape[1:3]), qkv.dtype)
        return jax.lax.fori_loop(0, STEPS, body, (o, conv_pool, state_pool))
    return jax.jit(run, donate_argnums=(2, 7))


def median_us_per_step(impls, args):
    """Median time of one step for each impl, each with its own pools, the runs interleaved."""
    fns = [chained(impl) for impl in impls]
    own = [list(args) for _ in impls]
    for fn, a in zip(fns, own):
        a[2], a[7] = jnp.copy(args[2]), jnp.copy(args[7])
        _, a[2], a[7] = jax.block_until_ready(fn(*a))  # compile and warm up
    times = [[] for _ in impls]
    for _ in range(REPEATS):
        for fn, a, runs in zip(fns, own, times):
            start = time.perf_counter()
            _, a[2], a[7] = jax.block_until_ready(fn(*a))
            runs.append(time.perf_counter() - start)
    return [1e6 * float(np.median(runs)) / STEPS for runs in times]



def check(impl, expected_impl, args, o_tolerance=1e-2, state_tolerance=1e-5):
    """One step of impl against expected_impl on copies of the pools; returns (o error, state error).
    Each step is jitted: run op by op, the XLA path compiled each of its primitives on its own, which
    took the first GPU run past the check's 60 s bound before it printed a row."""
    results = [jax.jit(lambda *a, name=name: kda_decode(*a, gate_lower_bound=GATE, impl=name))(
                   *args[:2], jnp.copy(args[2]), *args[3:7], jnp.copy(args[7]), args[8])
               for name in (impl, expected_impl)]
    (o, conv, state), (ref_o, ref_conv, ref_state) = results
    # o is bf16 (a rounding step is 2^-8 of a value); states are fp32 from exact fp32 products on both
    # paths, so only the order of summation differs; the conv windows are copies of bf16 rows.
    errors = relative_error(o, ref_o), relative_error(state, ref_state)
    assert errors[0] < o_tolerance and errors[1] < state_tolerance, f"{impl} vs {expected_impl}: errors {errors}"
    assert np.array_equal(np.asarray(conv, np.float32), np.asarray(ref_conv, np.float32)), "conv windows differ"
    return errors


def main() -> None:
    if jax.default_backend() != "gpu":
        print(f"gpu_check_kda_decode needs a GPU (backend: {jax.default_backend()}); running the interpret-mode "
              "check only")
        errors = check("pallas", "reference", inputs(3, 2, heads=2, dim=32))
        print(f"kda_decode: interpret mode matches the reference (errors {errors[0]:.1e}, {errors[1]:.1e})")
        return
    rows = []
    for n in ROWS:
        for t in TOKENS:
            args = inputs(n, t)
            o_err, s_err = check("pallas", "xla", args)
            pallas_us, xla_us = median_us_per_step(("pallas", "xla"), args)
            tbps = step_bytes(n, t) / pallas_us / 1e6
            rows.append({"N": n, "T": t, "pallas_us": pallas_us, "xla_us": xla_us, "pallas/xla": pallas_us / xla_us,
                         "MB": step_bytes(n, t) / 1e6, "pallas_TB/s": tbps, "frac_peak": tbps / PEAK_TBPS,
                         "xla_TB/s": step_bytes(n, t) / xla_us / 1e6, "o_err": o_err, "state_err": s_err})
            print(rows[-1], flush=True)  # a partial table survives the script's time bound
    report("gpu_check_kda_decode", rows,
           note=f"H={HEADS} K=V={DIM} W={WIDTH}, bf16 activations and conv pool, fp32 states, pools donated; "
                f"per step over {STEPS} chained steps, median of {REPEATS}; frac_peak of {PEAK_TBPS} TB/s")


if __name__ == "__main__":
    main()
