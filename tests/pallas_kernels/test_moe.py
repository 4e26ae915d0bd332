"""MoE expert FFN (XLA and reference) and the gated activations against NumPy float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.activations import GatedActivation
from pallas_kernels.moe import Mxfp4Tensor, expert_ffn, moe_ffn
from tests.convert.test_mxfp4 import np_decode

E, F, D = 8, 32, 64
SITU = GatedActivation("situ", 4.0, 25.0)
SILU = GatedActivation("silu")


def np_act(act, g, u):
    if act.kind == "silu":
        return g / (1 + np.exp(-g)) * u
    up = act.linear_beta * np.tanh(u / act.linear_beta) if act.linear_beta else u
    return act.beta * np.tanh(g / act.beta) / (1 + np.exp(-g)) * up


@pytest.mark.parametrize("act", [SITU, SILU, GatedActivation("situ", 2.0, None)])
def test_activations_match_numpy(act):
    g, u = np.random.default_rng(0).standard_normal((2, 1000)) * 20
    np.testing.assert_allclose(act(jnp.asarray(g), jnp.asarray(u)), np_act(act, g, u), rtol=1e-5, atol=1e-5)


def test_activation_errors():
    with pytest.raises(ValueError, match="unknown gated activation 'gelu'"):
        GatedActivation("gelu")
    with pytest.raises(ValueError, match="needs beta"):
        GatedActivation("situ")


def weights(mxfp4: bool, seed=0):
    rng = np.random.default_rng(seed)

    def one(out, inp):
        if mxfp4:
            return Mxfp4Tensor(jnp.asarray(rng.integers(0, 256, (E, out, inp // 2)), jnp.uint8),
                               jnp.asarray(rng.integers(121, 125, (E, out, inp // 32)), jnp.uint8))
        return jnp.asarray(rng.standard_normal((E, out, inp)) / np.sqrt(inp), jnp.float32)

    return one(F, D), one(F, D), one(D, F)


def np_weight(w):
    return np_decode(np.asarray(w.packed), np.asarray(w.scales)) if isinstance(w, Mxfp4Tensor) else np.asarray(w, np.float64)


def np_moe(x, ids, wts, ws, act):
    w1, w3, w2 = (np_weight(w) for w in ws)
    out = np.zeros((x.shape[0], D))
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], wts[t]):
            out[t] += wt * (np_act(act, w1[e] @ x[t], w3[e] @ x[t]) @ w2[e].T)
    return out


@pytest.mark.parametrize("mxfp4", [True, False])
@pytest.mark.parametrize("tokens, k", [(3, 2), (5, 4), (40, 2)])  # t*k < E takes the compaction path
@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_moe_ffn_matches_numpy(mxfp4, tokens, k, impl):
    rng = np.random.default_rng(tokens)
    ws = weights(mxfp4)
    x = rng.standard_normal((tokens, D))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)])
    wts = rng.uniform(0, 1, (tokens, k))
    out = jax.jit(lambda *a: moe_ffn(*a, *ws, activation=SITU, impl=impl))(
        jnp.asarray(x, jnp.float32), jnp.asarray(ids, jnp.int32), jnp.asarray(wts, jnp.float32))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, np_moe(x, ids, wts, ws, SITU), rtol=1e-4, atol=1e-4)


def test_all_tokens_on_one_expert_and_bf16():
    rng = np.random.default_rng(1)
    ws = weights(True)
    x = rng.standard_normal((16, D))
    ids = np.full((16, 1), 5)
    wts = np.ones((16, 1))
    out = moe_ffn(jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids, jnp.int32), jnp.asarray(wts, jnp.float32), *ws,
                  activation=SILU)
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    # bf16 activations (8-bit mantissa) into fp32-accumulated matmuls, hidden rounded to bf16 once
    np.testing.assert_allclose(out, np_moe(xb, ids, wts, ws, SILU), rtol=3e-2, atol=3e-2)


def test_expert_ffn_groups_empty_groups_and_padding_rows():
    rng = np.random.default_rng(2)
    ws = weights(True)
    sizes = np.array([2, 0, 3, 0, 0, 1, 0, 1])  # empty groups; 7 rows used, 2 padding rows
    x = rng.standard_normal((9, D))
    got = expert_ffn(jnp.asarray(x, jnp.float32), jnp.asarray(sizes, jnp.int32), *ws, activation=SITU)
    experts = np.repeat(np.arange(E), sizes)
    want = np_moe(x[:7], experts[:, None], np.ones((7, 1)), ws, SITU)
    np.testing.assert_allclose(got[:7], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[7:], 0.0)
    ref = expert_ffn(jnp.asarray(x, jnp.float32), jnp.asarray(sizes, jnp.int32), *ws, activation=SITU, impl="reference")
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_bad_arguments():
    ws = weights(False)
    x = jnp.zeros((2, D))
    with pytest.raises(ValueError, match="topk_ids"):
        moe_ffn(x, jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 2)), *ws, activation=SILU)
    with pytest.raises(ValueError, match="x has shape"):
        moe_ffn(jnp.zeros((2, D + 1)), jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 2)), *ws, activation=SILU)
    with pytest.raises(ValueError, match="group_sizes"):
        expert_ffn(x, jnp.zeros((3,), jnp.int32), *ws, activation=SILU)
    with pytest.raises(ValueError, match="not available yet"):
        moe_ffn(x, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 2)), *ws, activation=SILU, impl="pallas")
