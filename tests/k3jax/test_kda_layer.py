"""The KDA layer (projections, short conv, gate, delta rule, gated norm) against NumPy (ARCHITECTURE.md, "KDA")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.decoder import Batch
from k3jax.layers.kda import KDACache, KimiDeltaAttention
from tests.k3jax.tiny_configs import k3_tiny, kimi_linear_tiny


def np_kda_layer(layer, cfg, x, conv_prev=None, state=None):
    """One sequence x [T, H] in float64; returns (out, conv window, state)."""
    w = lambda lin: np.asarray(lin.kernel[...], np.float64).T  # [in, out]  # noqa: E731
    t = x.shape[0]
    heads, d, size = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    qkv = np.concatenate([x @ w(layer.q_proj), x @ w(layer.k_proj), x @ w(layer.v_proj)], -1)
    taps = np.concatenate([np.asarray(p[...], np.float64) for p in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)], -1)
    prev = np.zeros((size - 1, qkv.shape[1])) if conv_prev is None else conv_prev
    window = np.concatenate([prev, qkv])
    conv = np.stack([sum(taps[j] * window[i + j] for j in range(size)) for i in range(t)])
    conv = conv / (1 + np.exp(-conv))
    q, k, v = (a.reshape(t, heads, d) for a in np.split(conv, 3, -1))
    q = q / np.sqrt((q ** 2).sum(-1, keepdims=True) + 1e-6) * d ** -0.5
    k = k / np.sqrt((k ** 2).sum(-1, keepdims=True) + 1e-6)
    f = ((x @ w(layer.f_a_proj)) @ w(layer.f_b_proj) + np.asarray(layer.dt_bias[...])).reshape(t, heads, d)
    a = np.exp(np.asarray(layer.A_log[...], np.float64))[:, None]
    if cfg.kda_gate_lower_bound is not None:
        g = cfg.kda_gate_lower_bound / (1 + np.exp(-a * f))
    else:
        g = -a * np.where(f > 20, f, np.log1p(np.exp(np.minimum(f, 20))))
    beta = 1 / (1 + np.exp(-(x @ w(layer.b_proj))))
    s = np.zeros((heads, d, d)) if state is None else state.copy()  # [head, K, V]
    o = np.zeros((t, heads, d))
    for i in range(t):
        for h in range(heads):
            s[h] = np.exp(g[i, h])[:, None] * s[h]
            err = v[i, h] - s[h].T @ k[i, h]
            s[h] += np.outer(k[i, h], beta[i, h] * err)
            o[i, h] = s[h].T @ q[i, h]
    gate = x @ w(layer.g_proj) if cfg.kda_full_rank_gate else (x @ w(layer.g_a_proj)) @ w(layer.g_b_proj)
    y = o / np.sqrt((o ** 2).mean(-1, keepdims=True) + cfg.kda_output_norm_eps) * np.asarray(layer.o_norm[...])
    y = y * (1 / (1 + np.exp(-gate.reshape(t, heads, d))))
    return y.reshape(t, -1) @ w(layer.o_proj), window[-(size - 1):], s


@pytest.mark.parametrize("make_cfg", [k3_tiny, kimi_linear_tiny])
def test_layer_matches_numpy_and_carries_state(make_cfg):
    cfg = make_cfg()
    layer = KimiDeltaAttention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    layer.dt_bias[...] = jnp.asarray(rng.uniform(-1, 1, cfg.kda_projection_size), jnp.float32)
    x = rng.standard_normal((1, 70, cfg.hidden_size))
    ref_first, conv, state = np_kda_layer(layer, cfg, x[0, :66])
    ref_next, _, _ = np_kda_layer(layer, cfg, x[0, 66:], conv, state)
    with jax.default_matmul_precision("highest"):
        cache = KDACache.zeros(cfg, 1, jnp.float32)
        ones = lambda n: Batch(jnp.ones((1, n), bool), jnp.full((1,), n, jnp.int32), jnp.zeros((1,), jnp.int32))  # noqa: E731
        first, cache = layer(jnp.asarray(x[:, :66], jnp.float32), cache, ones(66))
        np.testing.assert_allclose(cache.conv[0].reshape(conv.shape), conv, rtol=1e-5, atol=1e-6)  # [W-1, 3, P]
        np.testing.assert_allclose(cache.state[0], state, rtol=1e-4, atol=1e-5)
        outs = []
        for t in range(66, 70):
            o, cache = layer(jnp.asarray(x[:, t:t + 1], jnp.float32), cache, ones(1))
            outs.append(o)
    # fp32 over 66 recurrent steps: 1e-4 relative, 5e-5 absolute for outputs near zero
    np.testing.assert_allclose(first[0], ref_first, rtol=1e-4, atol=5e-5)
    np.testing.assert_allclose(jnp.concatenate(outs, 1)[0], ref_next, rtol=1e-4, atol=5e-5)
