"""Gated activations against their NumPy float64 formulas (ARCHITECTURE.md, "MoE and LatentMoE")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.activations import GatedActivation


def np_sigmoid(x):
    return 0.5 * (1 + np.tanh(x / 2))  # no overflow for large |x|


def np_activation(kind, beta, linear_beta, g, u):
    if kind == "silu":
        return g * np_sigmoid(g) * u
    up = u if linear_beta is None else linear_beta * np.tanh(u / linear_beta)
    return beta * np.tanh(g / beta) * np_sigmoid(g) * up


@pytest.mark.parametrize("kind, beta, linear_beta", [("situ", 4.0, 25.0), ("situ", 2.0, None), ("silu", None, None)])
def test_matches_numpy(kind, beta, linear_beta):
    rng = np.random.default_rng(0)
    g, u = rng.standard_normal((2, 4096)) * 20  # well into the tanh / sigmoid saturation
    got = GatedActivation(kind, beta, linear_beta)(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32))
    assert got.dtype == jnp.float32
    g32, u32 = g.astype(np.float32).astype(np.float64), u.astype(np.float32).astype(np.float64)
    want = np_activation(kind, beta, linear_beta, g32, u32)
    # fp32 evaluation: a handful of roundings and tanh/exp ulps, relative ~1e-6; atol covers the
    # cancellation-free but tiny values near gate = 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_k3_situ_equals_the_kernel_form():
    """beta 4, linear_beta 25: 2 tanh(g/4) (1 + tanh(g/2)) 25 tanh(u/25), as written in kernels."""
    g, u = np.random.default_rng(1).standard_normal((2, 1000)) * 10
    got = GatedActivation("situ", 4.0, 25.0)(jnp.asarray(g), jnp.asarray(u))
    want = 2 * np.tanh(g / 4) * (1 + np.tanh(g / 2)) * 25 * np.tanh(u / 25)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_are_computed_in_fp32():
    g = jnp.asarray([-3.0, -0.5, 0.0, 0.75, 9.0], jnp.bfloat16)
    u = jnp.asarray([1.0, -2.0, 3.0, 40.0, 0.5], jnp.bfloat16)
    got = GatedActivation("situ", 4.0, 25.0)(g, u)
    assert got.dtype == jnp.float32
    want = np_activation("situ", 4.0, 25.0, np.asarray(g, np.float64), np.asarray(u, np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_is_a_hashable_static_argument():
    act = GatedActivation("situ", 4.0, 25.0)
    assert act == GatedActivation("situ", 4.0, 25.0) and hash(act) == hash(GatedActivation("situ", 4.0, 25.0))
    f = jax.jit(lambda a, g, u: a(g, u), static_argnums=0)
    x = jnp.ones(3)
    np.testing.assert_allclose(f(act, x, x), act(x, x))
    np.testing.assert_allclose(f(GatedActivation("silu"), x, x), jax.nn.silu(x) * x)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown gated activation 'gelu'"):
        GatedActivation("gelu")
    with pytest.raises(ValueError, match="'situ' activation needs beta"):
        GatedActivation("situ")
    with pytest.raises(AttributeError):
        GatedActivation("silu").kind = "situ"  # frozen
