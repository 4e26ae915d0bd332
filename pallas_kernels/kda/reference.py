"""Plain KDA recurrence, one token at a time: the oracle for the other implementations.

Per head, with the state S [K, V] in fp32:
    S <- diag(exp(g_t)) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T (scale q_t).
Packed sequences (`cu_seqlens`) run in the same scan: the state is reset to the sequence's initial
state at its first token, and the state after every token is written to that sequence's row of the
final states, so the last write is the state after its last token. `cu_seqlens` may be traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

L2_NORM_EPS = 1e-6  # inside the square root, as fla and the K3 engines
_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)  # fp32 products on every backend


def l2_normalize(x):
    """x / sqrt(sum x^2 + 1e-6) over the last axis (fla's use_qk_l2norm_in_kernel)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_NORM_EPS)


def recurrent_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, l2norm):
    """q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] in any float dtype; initial_state fp32.
    Returns (o fp32 [B, T, H, V], final state fp32 [N, H, K, V])."""
    t = q.shape[1]
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))  # scan over time

    def token(state, q_t, k_t, v_t, g_t, beta_t):
        """One token for every batch row and head; state [B, H, K, V], q_t [B, H, K]."""
        q_t, k_t, v_t, g_t, beta_t = (a.astype(jnp.float32) for a in (q_t, k_t, v_t, g_t, beta_t))
        if l2norm:
            q_t, k_t = l2_normalize(q_t), l2_normalize(k_t)
        state = state * jnp.exp(g_t)[..., None]
        error = v_t - _einsum("bhkv,bhk->bhv", state, k_t)
        state = state + _einsum("bhk,bhv->bhkv", k_t, beta_t[..., None] * error)
        return state, _einsum("bhkv,bhk->bhv", state, scale * q_t)

    if cu_seqlens is None:
        state, o = jax.lax.scan(lambda s, x: token(s, *x), initial_state, xs)
        return jnp.moveaxis(o, 0, 1), state

    tokens = jnp.arange(t)
    seq = jnp.searchsorted(cu_seqlens[1:], tokens, side="right").astype(jnp.int32)  # skips empty sequences
    starts = tokens == cu_seqlens[seq]

    def step(carry, x):
        state, finals = carry
        n, is_start, *inputs = x
        state = jnp.where(is_start, initial_state[n][None], state)  # the batch axis is 1 when packed
        state, o = token(state, *inputs)
        return (state, finals.at[n].set(state[0])), o

    (_, finals), o = jax.lax.scan(step, (initial_state[:1], initial_state), (seq, starts, *xs))
    return jnp.moveaxis(o, 0, 1), finals
