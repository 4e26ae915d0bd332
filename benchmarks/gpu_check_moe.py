"""Routed experts on a GPU: the Pallas-Triton MXFP4 grouped matmul against the XLA path.

    python -m benchmarks.gpu_check_moe

K3 per device on 16 devices: 56 of the 896 experts, expert input D = 3584 (the latent), F = 3072,
MXFP4 weights, bf16 rows, SiTU. Rows are spread over the experts at random (uniform routing):
M = 64, 256 and 1024 routed rows (decode: 64 tokens x top-16 / 16 devices = 64) and 16384
(prefill). Under expert parallelism (sharding/expert_parallel.py) the kernel is handed every
routed row of the step, T * 16, of which only its own experts' (about 1/16) are real and the rest
padding: the last two sizes run 64 and 256 tokens that way. The XLA path is what runs without the
kernel: lax.ragged_dot on weights dequantized to bf16 (with M < E only the experts in use are
gathered and dequantized).

Each size is checked against the XLA path before it is timed: median of REPEATS runs after a
warm-up, the two paths interleaved.

TB/s counts the MXFP4 bytes the kernel must read: packed codes and scales of the three matrices of
each expert that has rows (activations are negligible at decode). The issue's target is 60% of the
H200's 4.8 TB/s at decode sizes. TFLOP/s counts 2 * (real rows) * 3 * F * D (bf16 dot peak 990).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import report
from benchmarks.timing import median_us, relative_error
from pallas_kernels.activations import GatedActivation
from pallas_kernels.moe import Mxfp4Tensor, expert_ffn

REPEATS = 10
EXPERTS, F, D = 56, 3072, 3584
# (rows handed to the kernel, real rows among them)
SIZES = ((64, 64), (256, 256), (1024, 1024), (16384, 16384), (64 * 16, 64), (256 * 16, 256))
SITU = GatedActivation("situ", 4.0, 25.0)
PEAK_TFLOPS, PEAK_TBPS = 990.0, 4.8  # H200: dense bf16, HBM
# Outputs are bf16 (2**-8 relative); the two paths sum in different fp32 orders and may round the
# bf16 hidden activation differently, so allow 4 ulps of the largest output.
TOLERANCE = 2.0 ** -6


def random_weights(num_experts: int, f: int, d: int, seed: int = 0):
    """MXFP4 w_gate, w_up [E, F, D] and w_down [E, D, F], made on the device: random codes, scale
    bytes 118..121 (outputs of order 1)."""
    keys = iter(jax.random.split(jax.random.key(seed), 6))

    def one(out, inp):
        packed = jax.random.randint(next(keys), (num_experts, out, inp // 2), 0, 256).astype(jnp.uint8)
        scales = jax.random.randint(next(keys), (num_experts, out, inp // 32), 118, 122).astype(jnp.uint8)
        return Mxfp4Tensor(packed, scales)

    return one(f, d), one(f, d), one(d, f)


def routed_rows(m: int, real: int, num_experts: int, d: int, seed: int = 0):
    """bf16 rows [m, d] sorted by expert and the int32 group sizes of a uniform routing of the first
    `real` rows (the rest padding)."""
    rng = np.random.default_rng(seed)
    sizes = np.bincount(rng.integers(0, num_experts, real), minlength=num_experts)
    return jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16), jnp.asarray(sizes, jnp.int32)




def measure(m: int, real: int, weights, impls=("pallas", "xla")) -> dict:
    """One table row: both implementations at m rows (`real` of them routed), checked against each
    other, timed."""
    num_experts, f, d = weights[0].shape
    x, sizes = routed_rows(m, real, num_experts, d, seed=m)
    fns = [jax.jit(lambda x, s, *w, impl=impl: expert_ffn(x, s, *w, activation=SITU, impl=impl)) for impl in impls]
    args = (x, sizes, *weights)
    error = relative_error(*(fn(*args) for fn in fns))
    assert error < TOLERANCE, f"M={m}: pallas and xla differ by {error:.2e} of the largest output"
    pallas_us, xla_us = median_us(fns, args, REPEATS)
    active = int(np.count_nonzero(np.asarray(sizes)))
    weight_bytes = active * 3 * f * d * (1 / 2 + 1 / 32)  # packed codes + one scale byte per 32
    flops = 2.0 * real * 3 * f * d
    return {"M": m, "real_rows": real, "active_experts": active, "pallas_us": pallas_us, "xla_us": xla_us, "xla/pallas": xla_us / pallas_us,
            "pallas_TB/s": weight_bytes / pallas_us / 1e6, "frac_HBM": weight_bytes / pallas_us / 1e6 / PEAK_TBPS,
            "pallas_TFLOP/s": flops / pallas_us / 1e6, "frac_bf16_peak": flops / pallas_us / 1e6 / PEAK_TFLOPS,
            "max_rel_err": error}


def main() -> None:
    if jax.default_backend() != "gpu":
        print(f"gpu_check_moe needs a GPU (backend: {jax.default_backend()}); running the interpret-mode check only")
        row = measure(40, 30, random_weights(4, 64, 128), impls=("pallas", "reference"))
        print(f"interpret mode matches the reference: max error {row['max_rel_err']:.1e} of the largest output")
        return
    weights = random_weights(EXPERTS, F, D)
    rows = [measure(m, real, weights) for m, real in SIZES]
    report("gpu_check_moe", rows, f"{jax.devices()[0].device_kind}, {EXPERTS} experts, D={D}, F={F}, MXFP4, bf16; "
           "TB/s: MXFP4 bytes of the experts with rows; target >= 60% of HBM at decode sizes")


if __name__ == "__main__":
    main()
