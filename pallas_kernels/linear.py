"""x . w^T for a weight stored [out, in] (the checkpoint's orientation, as torch keeps it), with fp32
accumulation: every dense projection and the CPU expert loop run it.

On XLA:CPU a product of a few rows reads its weight from memory two to three times faster with the
weight as the left operand (w . x^T, then the small result transposed) than as the right one, where
the library packs the weight first. fp32, 2 cores, GB/s of weight read (medians of 7 runs over
weights that do not stay in cache; one row is a matrix-vector product either way):

    rows                    1     4     16    64
    [1024, 1024] w . x^T    27    22    17    8
                 x . w^T    27    10    10    6.5  (x . w with w kept [in, out]: 27 / 14 / 7 / -)
    [32000, 1024] w . x^T   16    16    13    4.0
                  x . w^T   15    5.8   7.2   3.4  (x . w with w kept [in, out]: 16 / 5.8 / 4.3 / 2.9)

Past MAX_LEFT_ROWS rows the product is compute-bound and the plain form is as fast. bf16 takes the
plain form too (XLA:CPU's DotThunk has no bf16 x bf16 -> f32 product with the weight on the left),
and so do other backends, whose libraries run it without moving the weight.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MAX_LEFT_ROWS = 64
_CONTRACT_LAST = (((1,), (1,)), ((), ()))


def linear(x, w_OI, out_dtype=jnp.float32):
    """x [..., in] . w [out, in]^T -> [..., out] in out_dtype, accumulated in fp32 (w cast to x's dtype)."""
    w_OI = w_OI.astype(x.dtype)
    rows = math.prod(x.shape[:-1])
    if rows > MAX_LEFT_ROWS or x.dtype != jnp.float32 or jax.default_backend() != "cpu":
        y = jax.lax.dot_general(x, w_OI, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return y.astype(out_dtype)
    y_OR = jax.lax.dot_general(w_OI, x.reshape(rows, x.shape[-1]), _CONTRACT_LAST, preferred_element_type=jnp.float32)
    # The barrier keeps XLA from folding the transpose back into the product (which swaps its operands).
    return jax.lax.optimization_barrier(y_OR).T.astype(out_dtype).reshape(*x.shape[:-1], w_OI.shape[0])
