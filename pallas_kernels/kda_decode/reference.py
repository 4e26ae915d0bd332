"""The KDA decode step written plainly, one sequence row and one token at a time: the test oracle.

Per row n (slot s = slots[n]) and token t, with the conv window X (the slot's W-1 pre-conv rows
followed by the row's new ones) and the state S [H, K, V] in fp32:
    u_t = silu(sum_j w[j] X[t + j])  (rounded to the activation dtype, as the model does)
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
    n, t, _, p = qkv.shape
    h = a_log.shape[0]
    d = p // h
    width = conv_weight.shape[0]
    outputs, windows, finals, all_states = [], [], [], []
    for row in range(n):
        slot = slots[row]
        window = jnp.concatenate([conv_pool[slot].astype(qkv.dtype), qkv[row]], axis=0)  # [W-1+T, 3, P]
        state = state_pool[slot]
        o_row, states_row = [], []
        for i in range(t):
            taps = window[i:i + width].astype(jnp.float32)  # [W, 3, P]
            u = jax.nn.silu(jnp.sum(taps * conv_weight, axis=0)).astype(qkv.dtype).astype(jnp.float32)
            q, k, v = (u[c].reshape(h, d) for c in range(3))
            q, k = l2_normalize(q), l2_normalize(k)
            g = log_decay(f[row, i].reshape(h, d), dt_bias.reshape(h, d), a_log, gate_lower_bound)
            beta = jax.nn.sigmoid(beta_logits[row, i].astype(jnp.float32))
            state = state * jnp.exp(g)[:, :, None]
            error = v - _einsum("hkv,hk->hv", state, k)
            state = state + _einsum("hk,hv->hkv", k, beta[:, None] * error)
            o_row.append(_einsum("hkv,hk->hv", state, d ** -0.5 * q))
            states_row.append(state)
        outputs.append(jnp.stack(o_row))
        windows.append(window[t:])
        finals.append(state)
        all_states.append(jnp.stack(states_row))
    o = jnp.stack(outputs).astype(qkv.dtype)
    if return_states:
        return o, jnp.stack(all_states)
    conv_pool = conv_pool.at[slots].set(jnp.stack(windows).astype(conv_pool.dtype))
    return o, conv_pool, state_pool.at[slots].set(jnp.stack(finals))
