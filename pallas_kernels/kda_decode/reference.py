"""The KDA decode step written plainly, one token at a time: the test oracle.

Per row n (slot s = slots[n]) and token t, carrying the conv window X (the W-1 pre-conv rows before
t, first the slot's) and the state S [H, K, V] in fp32:
    u_t = silu(sum_j w[j] [X, x_t][j])  (rounded to the activation dtype, as the model does)
    X <- [X, x_t] less its first row
    q, k = l2norm(u_t[q]), l2norm(u_t[k]);  v = u_t[v]
    g = gate(f_t + dt_bias);  beta = sigmoid(beta_logits_t)
    S <- diag(exp(g)) S;  S <- S + k (beta (v - S^T k))^T;  o_t = S^T (K**-0.5 q)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

L2_NORM_EPS = 1e-6  # inside the square root, as fla and the K3 engines
SOFTPLUS_LINEAR_ABOVE = 20.0  # softplus(x) = x above this, as torch and the model
_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def log_decay(f, dt_bias, a_log, gate_lower_bound):
    """Per-channel log decay (<= 0) from f [..., H, K] fp32; dt_bias [H, K]; a_log [H]."""
    s = f + dt_bias
    a = jnp.exp(a_log)[:, None]
    if gate_lower_bound is not None:  # K3's safe gate, in (lower bound, 0)
        return gate_lower_bound * jax.nn.sigmoid(a * s)
    softplus = jnp.where(s > SOFTPLUS_LINEAR_ABOVE, s, jnp.log1p(jnp.exp(jnp.minimum(s, SOFTPLUS_LINEAR_ABOVE))))
    return -a * softplus  # Kimi Linear


def l2_normalize(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_NORM_EPS)


def kda_decode(qkv, conv_weight, conv_pool, f, dt_bias, a_log, beta_logits, state_pool, slots, *,
               gate_lower_bound, return_states):
    """Arguments and results as api.kda_decode."""
    n, _, _, p = qkv.shape
    h = a_log.shape[0]
    d = p // h

    def token(carry, inputs):
        window, state = carry  # [N, W-1, 3, P] pre-conv rows, [N, H, K, V]
        x, f_t, beta_logits_t = inputs
        taps = jnp.concatenate([window, x[:, None]], axis=1)  # [N, W, 3, P], the last one the current token
        u = jax.nn.silu(jnp.sum(taps.astype(jnp.float32) * conv_weight, axis=1))
        q, k, v = (u.astype(qkv.dtype).astype(jnp.float32)[:, c].reshape(n, h, d) for c in range(3))
        q, k = l2_normalize(q), l2_normalize(k)
        g = log_decay(f_t.reshape(n, h, d), dt_bias.reshape(h, d), a_log, gate_lower_bound)
        beta = jax.nn.sigmoid(beta_logits_t.astype(jnp.float32))
        state = state * jnp.exp(g)[..., None]
        error = v - _einsum("nhkv,nhk->nhv", state, k)
        state = state + _einsum("nhk,nhv->nhkv", k, beta[..., None] * error)
        o = _einsum("nhkv,nhk->nhv", state, d ** -0.5 * q)
        return (taps[:, 1:], state), (o, state)

    inputs = tuple(jnp.moveaxis(x, 1, 0) for x in (qkv, f, beta_logits))  # scan over the T tokens
    (window, state), (o, states) = jax.lax.scan(token, (conv_pool[slots].astype(qkv.dtype), state_pool[slots]), inputs)
    o = jnp.moveaxis(o, 0, 1).astype(qkv.dtype)
    if return_states:
        return o, jnp.moveaxis(states, 0, 1)
    return o, conv_pool.at[slots].set(window.astype(conv_pool.dtype)), state_pool.at[slots].set(state)
