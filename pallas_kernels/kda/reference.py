"""Plain KDA recurrence, one token at a time: the oracle for the other implementations.

Per head, with the state S [K, V] (fp32): S <- diag(exp(g_t)) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T;
o_t = S^T (scale q_t). Packed sequences (`cu_seqlens`) must be concrete here: each runs on its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def recurrent_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens):
    """Inputs already fp32 and normalised; returns (o fp32 [B, T, H, V], final_state [N, H, K, V])."""
    if cu_seqlens is None:
        return _run(q, k, v, g, beta, scale, initial_state)
    bounds = np.asarray(cu_seqlens)
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        part = slice(int(bounds[n]), int(bounds[n + 1]))
        o, s = _run(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], scale, initial_state[n:n + 1])
        outs.append(o)
        finals.append(s)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(finals, axis=0)


def _run(q, k, v, g, beta, scale, state):
    def step(state, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        state = state * jnp.exp(g_t)[..., None]
        error = v_t - jnp.einsum("bhkv,bhk->bhv", state, k_t)
        state = state + jnp.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * error)
        return state, jnp.einsum("bhkv,bhk->bhv", state, scale * q_t)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state
