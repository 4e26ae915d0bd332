"""pallas_kernels.linear: x . w^T for [out, in] weights equals NumPy's for any row count and leading
shape, and on CPU a few-row fp32 product keeps the weight as the dot's left operand (the orientation
the module measures as two to three times faster) instead of XLA folding it back."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear import MAX_LEFT_ROWS, linear


@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5), (MAX_LEFT_ROWS,), (MAX_LEFT_ROWS + 1,), (3, 40)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_matches_numpy(lead, dtype):
    rng = np.random.default_rng(len(lead) * 100 + lead[-1])
    x = jnp.asarray(rng.standard_normal((*lead, 48)), dtype)
    w = jnp.asarray(rng.standard_normal((24, 48)), dtype)
    got = jax.jit(linear)(x, w)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert got.dtype == jnp.float32 and got.shape == (*lead, 24)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)  # exact products, fp32 sums
    assert jax.jit(lambda x, w: linear(x, w, x.dtype))(x, w).dtype == dtype


def _dot_operands(x, w):
    """The (lhs, rhs) shapes of the compiled program's one dot."""
    hlo = jax.jit(linear).lower(x, w).compile().as_text()
    (line,) = [l for l in hlo.splitlines() if re.search(r"= f32\[[\d,]*\]\{[\d,]*\} dot\(", l)]
    operands = re.search(r"dot\(([^)]*)\)", line).group(1).split(", ")
    shapes = {m.group(1): m.group(2) for m in re.finditer(r"%(\S+) = \w+\[([\d,]*)\]", hlo)}
    return tuple(shapes[o.lstrip("%")] for o in operands)


def test_a_few_fp32_rows_take_the_weight_as_the_left_operand():
    w = jnp.ones((256, 128), jnp.float32)
    assert _dot_operands(jnp.ones((4, 128), jnp.float32), w) == ("256,128", "4,128")
    # many rows: the plain form, rows on the left
    assert _dot_operands(jnp.ones((MAX_LEFT_ROWS + 1, 128), jnp.float32), w) == (f"{MAX_LEFT_ROWS + 1},128", "256,128")
