"""MLA on a GPU: the Pallas-Triton kernels against the XLA path at K3's per-device shapes (8 heads at TP8).

    python -m benchmarks.gpu_check_mla

Prefill: causal_attention, naive form, B = 1, T = 8192, qk 192 (128 + 64), v 128, bf16. FLOPs are
those of causal attention, 2 (Dqk + Dv) per visible (query, key) pair and head: T (T + 1) / 2 pairs.
Paged decode: paged_decode_attention, absorbed form, 64 sequences x 8192 tokens of context in pages
of 64 rows of 576 (512 latent + 64 shared key), bf16 and fp8 E4M3 pages, the pages of each sequence
scattered over the pool. Decode is memory bound: its TB/s counts the page bytes read once
(B x context x 576 x itemsize); the target is 70% of the H200's 4.8 TB/s.

Each kernel is checked against the XLA path before it is timed: median of REPEATS runs after a
warm-up, the two paths interleaved.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import report
from benchmarks.timing import median_us, relative_error
from pallas_kernels.mla import causal_attention, paged_decode_attention

REPEATS = 7
HEADS, QK_DIM, V_DIM, LATENT, CACHE_WIDTH = 8, 192, 128, 512, 576
PREFILL_T = 8192
DECODE_BATCH, CONTEXT, PAGE = 64, 8192, 64
PEAK_TFLOPS, PEAK_TBPS = 990.0, 4.8  # H200: dense bf16, HBM
TOLERANCE = 2.0 ** -6  # bf16 outputs and bf16 softmax weights on both paths, relative to the largest |output|




def compare(fns, args, name):
    """Checks fns[0] (Pallas) against fns[1] (XLA); returns ([pallas_us, xla_us], error)."""
    got, want = (fn(*args) for fn in fns)
    error = relative_error(got, want)
    assert error < TOLERANCE, f"{name}: Pallas vs XLA relative error {error:.2e}"
    return median_us(fns, args, REPEATS), error


def prefill_inputs(t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.standard_normal((1, t, HEADS, QK_DIM)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, t, HEADS, V_DIM)), jnp.bfloat16)
    return q, k, v, jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32)


def decode_inputs(batch: int, context: int, pages_dtype, seed: int = 0):
    """q [B, 8, 576] bf16; a pool of B x context / PAGE pages (plus a null page 0) in shuffled order;
    kv_scale chosen so that the stored fp8 values span e4m3's range."""
    rng = np.random.default_rng(seed)
    per_seq = context // PAGE
    num_pages = 1 + batch * per_seq
    kv_scale = jnp.float32(1.0 if pages_dtype == jnp.bfloat16 else 1.0 / 64)
    pages = (jax.random.normal(jax.random.key(seed), (num_pages, PAGE, CACHE_WIDTH), jnp.float32)
             / kv_scale).astype(pages_dtype)
    table = jnp.asarray(1 + rng.permutation(batch * per_seq).reshape(batch, per_seq), jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, HEADS, CACHE_WIDTH)), jnp.bfloat16)
    return q, pages, table, jnp.full((batch,), context, jnp.int32), kv_scale


def interpret_check() -> None:
    """Off a GPU: both kernels in interpret mode against the reference on small shapes."""
    q, k, v, offset, length = prefill_inputs(40)
    got, want = (causal_attention(q, k, v, q_offset=offset, kv_length=length, scale=QK_DIM ** -0.5, impl=impl)
                 for impl in ("pallas", "reference"))
    error = relative_error(got, want)
    assert error < TOLERANCE, f"prefill: interpret-mode error {error:.2e}"
    print(f"causal_attention: interpret mode matches the reference (error {error:.1e})")
    for pages_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        q, pages, table, lengths, kv_scale = decode_inputs(2, 3 * PAGE, pages_dtype)
        got, want = (paged_decode_attention(q, pages, table, lengths - 5, scale=CACHE_WIDTH ** -0.5,
                                             kv_scale=kv_scale, impl=impl) for impl in ("pallas", "reference"))
        error = relative_error(got, want)
        assert error < TOLERANCE, f"paged decode {jnp.dtype(pages_dtype).name}: interpret-mode error {error:.2e}"
        print(f"paged_decode_attention ({jnp.dtype(pages_dtype).name}): interpret mode matches the reference "
              f"(error {error:.1e})")


def main() -> None:
    if jax.default_backend() != "gpu":
        print(f"gpu_check_mla needs a GPU (backend: {jax.default_backend()}); running the interpret-mode check only")
        interpret_check()
        return
    rows = []
    prefill = [jax.jit(lambda q, k, v, o, n, impl=impl: causal_attention(
        q, k, v, q_offset=o, kv_length=n, scale=QK_DIM ** -0.5, impl=impl)) for impl in ("pallas", "xla")]
    (pallas_us, xla_us), error = compare(prefill, prefill_inputs(PREFILL_T), "prefill")
    flops = 2.0 * (QK_DIM + V_DIM) * PREFILL_T * (PREFILL_T + 1) / 2 * HEADS
    rows.append({"op": "causal_attention", "shape": f"B=1 T={PREFILL_T}", "pallas_us": pallas_us, "xla_us": xla_us,
                 "pallas/xla": pallas_us / xla_us, "rate": flops / pallas_us / 1e6, "unit": "TFLOP/s",
                 "frac_peak": flops / pallas_us / 1e6 / PEAK_TFLOPS, "rel_err": error})
    for pages_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        decode = [jax.jit(lambda q, p, t, n, s, impl=impl: paged_decode_attention(
            q, p, t, n, scale=CACHE_WIDTH ** -0.5, kv_scale=s, impl=impl)) for impl in ("pallas", "xla")]
        name = f"paged_decode {jnp.dtype(pages_dtype).name}"
        (pallas_us, xla_us), error = compare(decode, decode_inputs(DECODE_BATCH, CONTEXT, pages_dtype), name)
        page_bytes = DECODE_BATCH * CONTEXT * CACHE_WIDTH * jnp.dtype(pages_dtype).itemsize
        rows.append({"op": name, "shape": f"B={DECODE_BATCH} ctx={CONTEXT} page={PAGE}", "pallas_us": pallas_us,
                     "xla_us": xla_us, "pallas/xla": pallas_us / xla_us, "rate": page_bytes / pallas_us / 1e6,
                     "unit": "TB/s", "frac_peak": page_bytes / pallas_us / 1e6 / PEAK_TBPS, "rel_err": error})
    report("gpu_check_mla", rows,
           note=f"H={HEADS}, median of {REPEATS}; frac_peak of {PEAK_TFLOPS:.0f} TFLOP/s (prefill) or "
                f"{PEAK_TBPS} TB/s (decode, target >= 0.7)")


if __name__ == "__main__":
    main()
