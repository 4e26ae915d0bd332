"""The KDA decode step in plain XLA: all rows at once, the T tokens unrolled (T is small and static).

Products are elementwise multiplies and sums rather than dots, so they are exact fp32 on every
backend and the whole token loop fuses into a few loop fusions over the gathered states.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda_decode.reference import l2_normalize, log_decay


def kda_decode(qkv, conv_weight, conv_pool, f, dt_bias, a_log, beta_logits, state_pool, slots, *,
               gate_lower_bound, return_states):
    """Arguments and results as api.kda_decode."""
    n, t, _, p = qkv.shape
    h = a_log.shape[0]
    d = p // h
    width = conv_weight.shape[0]
    conv_rows, state_rows = conv_pool[slots], state_pool[slots]
    if n == 1:
        # One row's gather and scatter become a dynamic slice and an in-place dynamic update; XLA then
        # copied the whole conv and state pools to keep the (fused, later) read of the slot apart from
        # its write. Materialising the row first (it is small) leaves the pools in place. More rows
        # stay a gather fused into its consumers, which the barrier would only materialise.
        conv_rows, state_rows, conv_pool, state_pool = jax.lax.optimization_barrier(
            (conv_rows, state_rows, conv_pool, state_pool))
    window = jnp.concatenate([conv_rows.astype(qkv.dtype), qkv], axis=1)  # [N, W-1+T, 3, P]
    taps = window.astype(jnp.float32)
    u = sum(taps[:, j:j + t] * conv_weight[j] for j in range(width))
    u = jax.nn.silu(u).astype(qkv.dtype).astype(jnp.float32).reshape(n, t, 3, h, d)
    q, k, v = l2_normalize(u[:, :, 0]) * d ** -0.5, l2_normalize(u[:, :, 1]), u[:, :, 2]  # [N, T, H, D] each
    decay = jnp.exp(log_decay(f.reshape(n, t, h, d), dt_bias.reshape(h, d), a_log, gate_lower_bound))  # [N, T, H, K]
    beta = jax.nn.sigmoid(beta_logits.astype(jnp.float32))  # [N, T, H]

    state = state_rows  # [N, H, K, V]
    outputs, states = [], []
    for i in range(t):
        state = state * decay[:, i, :, :, None]
        error = v[:, i] - jnp.sum(state * k[:, i, :, :, None], axis=2)  # [N, H, V]
        state = state + k[:, i, :, :, None] * (beta[:, i, :, None] * error)[:, :, None, :]
        outputs.append(jnp.sum(state * q[:, i, :, :, None], axis=2))
        states.append(state)
    o = jnp.stack(outputs, axis=1).astype(qkv.dtype)
    if return_states:
        return o, jnp.stack(states, axis=1)
    conv_pool = conv_pool.at[slots].set(window[:, t:].astype(conv_pool.dtype))
    return o, conv_pool, state_pool.at[slots].set(state)
