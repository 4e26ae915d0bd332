"""KDA in XLA: the chunked (WY/UT) form for prefill and a token scan for decode.

Chunked form, per head and chunk of C tokens with in-chunk cumulative log decay G (all <= 0, and
decreasing along the chunk) and the state S0 before the chunk:
    A[t, s]   = beta_t sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])   (s < t)
    Aqk[t, s] = sum_c q_t[c] k_s[c] exp(G_t[c] - G_s[c])          (s <= t)
    U = (I + A)^-1 (beta V) - (I + A)^-1 (beta K exp(G)) S0         (the delta-rule writes)
    O = (Q exp(G)) S0 + Aqk U
    S = exp(G_C) S0 + (K exp(G_C - G))^T U
Every exponent above is <= 0 except inside A and Aqk, which are built from 16-token sub-blocks
without overflow for any gate <= 0, including Kimi Linear's unbounded one (see _intra_scores).
Everything except the state passing is computed for all chunks at once; only the cheap
S -> U, O, S' step runs in a scan over chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64
SUB = 16
SAFE_SPAN = 60.0  # exp(60) ~ 1e26: far from fp32 overflow even after products


def chunk_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens):
    """Inputs fp32 [B, T, H, *], normalised; returns (o fp32 [B, T, H, V], final state)."""
    q = q * scale
    if cu_seqlens is not None:
        return _chunk_packed(q, k, v, g, beta, initial_state, cu_seqlens)
    b, t, h, _ = q.shape
    n = -(-t // CHUNK)
    chunks = [_to_chunks(a, n) for a in (q, k, v, g, beta)]  # [B, N, H, C, *]
    o, state = _inter(_prepare(*chunks), initial_state)
    return _from_chunks(o, t), state


def fused_recurrent_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens):
    """Token-by-token scan (decode: T is small). Packed sequences restart from their own state."""
    b, t, h, _ = q.shape
    q = q * scale
    if cu_seqlens is None:
        seq = jnp.zeros((t,), jnp.int32)
        first = jnp.arange(t) == 0
        states = initial_state
    else:
        seq = jnp.searchsorted(cu_seqlens[1:], jnp.arange(t), side="right").astype(jnp.int32)
        first = jnp.arange(t) == cu_seqlens[seq]
        states = initial_state[:, None]  # [N, 1 (batch), H, K, V]

    def step(carry, xs):
        state, finals = carry
        q_t, k_t, v_t, g_t, b_t, n, is_first = xs
        if cu_seqlens is not None:
            state = jnp.where(is_first, finals[n], state)
        state = state * jnp.exp(g_t)[..., None]
        error = v_t - jnp.einsum("bhkv,bhk->bhv", state, k_t)
        state = state + jnp.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * error)
        if cu_seqlens is not None:
            finals = jax.lax.dynamic_update_index_in_dim(finals, state, n, axis=0)
        return (state, finals), jnp.einsum("bhkv,bhk->bhv", state, q_t)

    init = initial_state if cu_seqlens is None else jnp.zeros_like(states[0])
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)) + (seq, first)
    (state, finals), o = jax.lax.scan(step, (init, states), xs)
    return jnp.moveaxis(o, 0, 1), state if cu_seqlens is None else finals[:, 0]


def _to_chunks(x, n):
    """[B, T, H, *] -> [B, N, H, C, *], zero-padded (g = beta = 0 leaves the state unchanged)."""
    b, t, h = x.shape[:3]
    x = jnp.pad(x, [(0, 0), (0, n * CHUNK - t)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(b, n, CHUNK, h, *x.shape[3:])
    return jnp.moveaxis(x, 3, 2)


def _from_chunks(o, t):
    b, n, h, c, v = o.shape
    return jnp.moveaxis(o, 2, 3).reshape(b, n * c, h, v)[:, :t]


def _prepare(q, k, v, g, beta):
    """Per-chunk quantities for all chunks at once; arrays [..., C, *]."""
    big_g = jnp.cumsum(g, axis=-2)
    a_kk, a_qk = _intra_scores(q, k, big_g)
    a = beta[..., :, None] * a_kk
    rhs = jnp.concatenate([beta[..., None] * v, beta[..., None] * k * jnp.exp(big_g)], axis=-1)
    solved = jax.lax.linalg.triangular_solve(a, rhs, left_side=True, lower=True, unit_diagonal=True)
    u, w = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    last = big_g[..., -1:, :]
    return u, w, q * jnp.exp(big_g), a_qk, k * jnp.exp(last - big_g), jnp.exp(last[..., 0, :])


def _intra_scores(q, k, big_g):
    """Strictly lower k.k and lower-inclusive q.k scores with per-channel decay: [..., C, C] each.

    Across 16-token sub-blocks a > b, exp(G_i - G_j) = exp(G_i - G_a0) exp(G_a0 - G_b1) exp(G_b1 - G_j)
    (a0: first token of a, b1: last of b), every factor <= 1. Inside a sub-block the same split at
    its first token needs exp(G_a0 - G_j) >= 1, which is safe while a sub-block decays by less than
    e^-SAFE_SPAN (always for K3's gate bound of -5); otherwise the exact rank-3 form is used.
    """
    lead, c, dk = q.shape[:-2], q.shape[-2], q.shape[-1]
    n = c // SUB
    qs, ks, gs = (x.reshape(*lead, n, SUB, dk) for x in (q, k, big_g))
    first, last = gs[..., :, :1, :], gs[..., :, -1:, :]
    qs_up, ks_up = qs * jnp.exp(gs - first), ks * jnp.exp(gs - first)
    ks_down = ks * jnp.exp(last - gs)
    cross = jnp.exp(jnp.minimum(first[..., :, None, 0, :] - last[..., None, :, 0, :], 0.0))  # [..., a, b, K]
    off_kk = jnp.einsum("...aik,...abk,...bjk->...abij", ks_up, cross, ks_down)
    off_qk = jnp.einsum("...aik,...abk,...bjk->...abij", qs_up, cross, ks_down)

    def factored():
        ks_inv = ks * jnp.exp(first - gs)
        return (jnp.einsum("...aik,...ajk->...aij", ks_up, ks_inv),
                jnp.einsum("...aik,...ajk->...aij", qs_up, ks_inv))

    def rank3():
        decay = jnp.exp(jnp.minimum(gs[..., :, :, None, :] - gs[..., :, None, :, :], 0.0))  # [..., a, i, j, K]
        return (jnp.einsum("...aik,...aijk,...ajk->...aij", ks, decay, ks),
                jnp.einsum("...aik,...aijk,...ajk->...aij", qs, decay, ks))

    diag_kk, diag_qk = jax.lax.cond(jnp.all(first - last < SAFE_SPAN), factored, rank3)
    blocks = jnp.arange(n)
    below = (blocks[:, None] > blocks[None, :])[:, :, None, None]
    same = (blocks[:, None] == blocks[None, :])[:, :, None, None]
    i = jnp.arange(SUB)
    strict, inclusive = i[:, None] > i[None, :], i[:, None] >= i[None, :]

    def assemble(off, diag, tri):
        full = jnp.where(below, off, 0.0) + jnp.where(same, jnp.where(tri, diag, 0.0)[..., :, None, :, :], 0.0)
        return jnp.swapaxes(full, -3, -2).reshape(*lead, c, c)

    return assemble(off_kk, diag_kk, strict), assemble(off_qk, diag_qk, inclusive)


def _chunk_step(state, u, w, qg, a_qk, kg, decay):
    """One chunk's state passing: state [..., K, V] -> (o [..., C, V], next state)."""
    writes = u - jnp.einsum("...ck,...kv->...cv", w, state)
    o = jnp.einsum("...ck,...kv->...cv", qg, state) + jnp.einsum("...cs,...sv->...cv", a_qk, writes)
    return o, decay[..., :, None] * state + jnp.einsum("...ck,...cv->...kv", kg, writes)


def _inter(prepared, initial_state):
    """Scan over chunks for batched sequences; prepared arrays [B, N, H, ...]."""

    def step(state, xs):
        o, state = _chunk_step(state, *xs)
        return state, o

    state, o = jax.lax.scan(step, initial_state, tuple(jnp.moveaxis(a, 1, 0) for a in prepared))
    return jnp.moveaxis(o, 0, 1), state


def _chunk_packed(q, k, v, g, beta, initial_state, cu_seqlens):
    """Packed sequences (B = 1): each starts at a chunk boundary of a padded layout, so no chunk
    spans two sequences; the state restarts from the sequence's initial state at its first chunk."""
    t = q.shape[1]
    num_seqs = initial_state.shape[0]
    n = -(-t // CHUNK) + num_seqs  # chunks needed in the worst case
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_chunks = (lengths + CHUNK - 1) // CHUNK
    chunk_start = jnp.cumsum(seq_chunks) - seq_chunks
    token_seq = jnp.searchsorted(cu_seqlens[1:], jnp.arange(t), side="right")
    dest = chunk_start[token_seq] * CHUNK + jnp.arange(t) - cu_seqlens[token_seq]

    def scatter(x):
        return jnp.zeros((n * CHUNK, *x.shape[2:]), x.dtype).at[dest].set(x[0])[None]

    chunks = [_to_chunks(scatter(a), n)[0] for a in (q, k, v, g, beta)]  # [N, H, C, *]
    prepared = _prepare(*chunks)
    index = jnp.arange(n)
    chunk_seq = jnp.clip(jnp.searchsorted(chunk_start + seq_chunks, index, side="right"), 0, num_seqs)
    owner = jnp.minimum(chunk_seq, num_seqs - 1)
    first = (index == chunk_start[owner]) & (chunk_seq < num_seqs)
    last = (index == chunk_start[owner] + seq_chunks[owner] - 1) & (chunk_seq < num_seqs)

    def step(carry, xs):
        state, finals = carry
        s, is_first, is_last, *arrays = xs
        state = jnp.where(is_first, initial_state[s], state)
        o, state = _chunk_step(state, *arrays)
        finals = jax.lax.dynamic_update_index_in_dim(finals, jnp.where(is_last, state, finals[s]), s, axis=0)
        return (state, finals), o

    zeros = jnp.zeros_like(initial_state[0])
    (_, finals), o = jax.lax.scan(step, (zeros, initial_state), (owner, first, last, *prepared))
    o = jnp.moveaxis(o, 1, 2).reshape(n * CHUNK, o.shape[1], o.shape[-1])  # [N*C, H, V]
    return o[dest][None], finals
