"""KDA prefill in XLA: fla's chunked (WY / UT) form, 64-token chunks.

Per head and chunk, with G the in-chunk cumulative log decay (per key channel, non-increasing),
and S the state [K, V] before the chunk:
    A[i, j]   = beta_i sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])     (j < i)
    Aqk[i, j] = sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])            (j <= i)
    u = (I + A)^-1 (beta v),   w = (I + A)^-1 (beta k exp(G))
    v' = u - w S;   o = (q exp(G)) S + Aqk v';   S <- exp(G_last) S + (k exp(G_last - G))^T v'
v' holds the delta-rule writes of the chunk; only the last line carries anything between chunks.

The sequence runs as a scan over steps of a few chunks (about CHUNK_HEADS_PER_STEP chunk-heads):
the per-chunk algebra is batched over the step and only the state passing is an inner scan over
its chunks. Inputs are cast, normalised and scaled as each step loads them. Batching over the
whole sequence instead makes every intermediate as large as the sequence: on CPU such fresh
buffers cost more in page faults than the arithmetic, and the steps bound the memory of long
prompts. Even so, on a 2-core CPU the token scan (reference.py) is the faster XLA form while the states
fit in cache (benchmarks/kda_chunked_vs_recurrent.py): the chunked form does more arithmetic, in small
matmuls, and hundreds of small ops per layer cost more than a short prompt's tokens. So chunk_kda's
impl="auto" takes the scan on CPU up to api.SCAN_STATE_VALUES of state; this form serves larger states
(K3's heads per rank) and the other backends' XLA path.

Every decay exponent is a sum of g over an interval of tokens, added up from pieces of one sign
(_DecaySums): a difference of two cumulative sums would carry an error of |G| * eps, far above fp32
rounding when the gates are strong.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda import layout
from pallas_kernels.kda.reference import l2_normalize

CHUNK = 64
CHUNK_HEADS_PER_STEP = 32
BLOCK = 16  # sub-block of a chunk, for the scores and the triangular solve
BLOCKS = CHUNK // BLOCK
# Largest exponent a factor of the split decay may carry (see _scores_fast): exp(40) ~ 2e17 leaves
# fp32 headroom both ways. K3's gate (g > -5 per step) always fits: 8 steps * 5 = 40.
SAFE_EXPONENT = 40.0

# fp32 products throughout: the default precision would let GPUs use TF32 and TPUs bf16 passes,
# which would also round the 0/+-1 sums of g below.
_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def chunk_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, l2norm):
    """q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], any float dtype; initial_state fp32.
    Returns (o fp32 [B, T, H, V], final state fp32 [N, H, K, V])."""
    b, t, h, _ = q.shape
    run = functools.partial(_chunked, scale=scale, initial_state=initial_state, l2norm=l2norm)
    if cu_seqlens is None:
        group, steps = _grouping(-(-t // CHUNK), b * h)
        padded = steps * group * CHUNK

        def pad(x):  # zero q, k, v, beta and g leave the state as it is
            return x if padded == t else jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2))

        o, final = run(*map(pad, (q, k, v, g, beta)), segments=None, group=group)
        return o[:, :t], final

    # Packed sequences: each one starts on a chunk boundary of a padded layout, so no chunk holds two.
    num_seqs = initial_state.shape[0]
    group, steps = _grouping(layout.num_chunks_bound(t, num_seqs, CHUNK), h)
    chunks = layout.chunk_layout(cu_seqlens, CHUNK, steps * group)
    dest = layout.padded_positions(cu_seqlens, t, CHUNK, chunks)

    def scatter(x):
        return jnp.zeros((1, steps * group * CHUNK, *x.shape[2:]), x.dtype).at[:, dest].set(x)

    o, finals = run(*map(scatter, (q, k, v, g, beta)), segments=(chunks.first, chunks.last, chunks.seq), group=group)
    return o[:, dest], finals


def _grouping(num_chunks, rows):
    """(chunks per step, steps) covering num_chunks (at least one chunk) with as little padding as possible."""
    most = max(1, min(num_chunks, CHUNK_HEADS_PER_STEP // rows))
    steps = max(1, -(-num_chunks // most))
    return max(1, -(-num_chunks // steps)), steps


def _chunked(q, k, v, g, beta, *, scale, initial_state, l2norm, segments, group):
    """Inputs [B, T, H, *] with T a multiple of group * CHUNK. Without segments each batch row is
    one sequence; with segments (B = 1) the state restarts from initial_state[seq] at a sequence's
    first chunk and is recorded as its final state at its last chunk. Returns (o, final states)."""
    b, t, h, _ = q.shape
    span = group * CHUNK

    def step(carry, i):
        def load(x):  # [B, span, H, *] -> fp32 [group, B, H, C, *]: chunks leading, for the inner scan
            x = jax.lax.dynamic_slice_in_dim(x, i * span, span, axis=1).astype(jnp.float32)
            return jnp.moveaxis(x.reshape(b, group, CHUNK, h, *x.shape[3:]), (1, 3), (0, 2))

        qc, kc, vc, gc, beta_c = map(load, (q, k, v, g, beta))
        if l2norm:
            qc, kc = l2_normalize(qc), l2_normalize(kc)
        u, w, q_decayed, a_qk, k_decayed, decay = _intra(qc * scale, kc, vc, gc, beta_c)
        xs = (u, w, k_decayed, decay)
        if segments is not None:
            xs += tuple(jax.lax.dynamic_slice_in_dim(x, i * group, group) for x in segments)
        carry, (before, writes) = jax.lax.scan(
            functools.partial(_pass_state, initial_state), carry, xs)
        o = (_einsum("...ck,...kv->...cv", q_decayed, before)
             + _einsum("...cs,...sv->...cv", a_qk, writes))  # [group, B, H, C, V]
        return carry, jnp.moveaxis(o, (0, 2), (1, 3)).reshape(b, span, h, -1)

    if segments is None:
        init = (initial_state, None)
    else:
        init = (jnp.zeros_like(initial_state[:1]), initial_state)  # empty sequences keep their row
    (state, finals), o = jax.lax.scan(step, init, jnp.arange(t // span))
    o = jnp.moveaxis(o, 0, 1).reshape(b, t, h, -1)  # free when B == 1
    return o, state if segments is None else finals


def _pass_state(initial_state, carry, xs):
    """One chunk of the state passing for all heads: returns the state before it and its writes v'."""
    state, finals = carry
    u, w, k_decayed, decay, *segment = xs
    if segment:
        first, last, seq = segment
        state = jnp.where(first, initial_state[seq][None], state)
    writes = u - _einsum("bhck,bhkv->bhcv", w, state)
    new_state = decay[..., None] * state + _einsum("bhck,bhcv->bhkv", k_decayed, writes)
    if segment:
        finals = finals.at[seq].set(jnp.where(last, new_state[0], finals[seq]))
    return (new_state, finals), (state, writes)


def _intra(q, k, v, g, beta):
    """Everything that needs no state, for chunks [..., C, *]: (u, w, q exp(G), Aqk, k exp(G_last - G), exp(G_last))."""
    sums = _DecaySums.of(g)
    # One decision for the whole step; K3's gate always takes the fast split.
    kk, qk = jax.lax.cond(jnp.all(jnp.abs(sums.from_middle) <= SAFE_EXPONENT),
                          _scores_fast, _scores_exact, q, k, sums)
    i = jnp.arange(CHUNK)
    a_kk = jnp.where(i[:, None] > i[None, :], kk, 0.0) * beta[..., :, None]
    a_qk = jnp.where(i[:, None] >= i[None, :], qk, 0.0)
    g_cum, to_last = _unblock(sums.cumulative), _unblock(sums.to_last)
    beta = beta[..., None]
    solved = _solve_unit_lower(a_kk, jnp.concatenate([beta * v, beta * k * jnp.exp(g_cum)], axis=-1))
    u, w = jnp.split(solved, [v.shape[-1]], axis=-1)
    return u, w, q * jnp.exp(g_cum), a_qk, k * jnp.exp(to_last), jnp.exp(g_cum[..., -1, :])


_MIDDLE = BLOCK // 2


def _in_block_sums():
    """[4 * BLOCK, BLOCK] of 0 / +-1: rows (head, tail, from_middle, from_first) x token t, summing
    g over the block's tokens s as _DecaySums names them; every row has one sign."""
    t, s = np.arange(BLOCK)[:, None], np.arange(BLOCK)[None, :]
    head = s <= t
    tail = s > t
    from_middle = np.where(t >= _MIDDLE, (_MIDDLE < s) & (s <= t), -1.0 * ((t < s) & (s <= _MIDDLE)))
    from_first = (0 < s) & (s <= t)
    return np.concatenate([head, tail, from_middle, from_first]).astype(np.float32)


_IN_BLOCK = _in_block_sums()
# [i, j, s]: the tokens s summed for G_i - G_j inside a block (j <= i).
_PAIRS = np.array([[[j < s <= i for s in range(BLOCK)] for j in range(BLOCK)] for i in range(BLOCK)], np.float32)
# [a, b, c]: block c lies strictly between blocks b and a.
_BETWEEN = np.array([[[b < c < a for c in range(BLOCKS)] for b in range(BLOCKS)] for a in range(BLOCKS)],
                    np.float32)
_EARLIER = np.tril(np.ones((BLOCKS, BLOCKS), np.float32), -1)  # [a, c]: c < a


class _DecaySums(NamedTuple):
    """Interval sums of g over chunks split into BLOCKS blocks: arrays [..., BLOCKS, BLOCK, K], and
    between [..., BLOCKS, BLOCKS, 1, K]. Each is added up from pieces of one sign."""
    g: jax.Array  # the steps themselves
    head: jax.Array  # G_t - G_(block start - 1)
    tail: jax.Array  # G_(block end) - G_t
    from_middle: jax.Array  # G_t - G_(block middle)
    from_first: jax.Array  # G_t - G_(block start)
    cumulative: jax.Array  # G_t: from the start of the chunk
    to_last: jax.Array  # G_(chunk end) - G_t
    between: jax.Array  # [a, b]: the sum over the blocks strictly between b and a

    @classmethod
    def of(cls, g):
        g = g.reshape(*g.shape[:-2], BLOCKS, BLOCK, g.shape[-1])
        head, tail, from_middle, from_first = jnp.split(_einsum("ts,...bsk->...btk", _IN_BLOCK, g), 4, axis=-2)
        total = head[..., -1, :]  # [..., BLOCKS, K]
        earlier = _einsum("ac,...ck->...ak", _EARLIER, total)[..., None, :]
        later = _einsum("ca,...ck->...ak", _EARLIER, total)[..., None, :]
        between = _einsum("abc,...ck->...abk", _BETWEEN, total)[..., None, :]
        return cls(g, head, tail, from_middle, from_first, earlier + head, tail + later, between)


def _unblock(x):
    return x.reshape(*x.shape[:-3], CHUNK, x.shape[-1])


# The kk and qk scores, sum_c x_i[c] k_j[c] exp(G_i[c] - G_j[c]) for x = k, q and j <= i, come from
# splitting the decay at a reference token R per block of query rows:
#     (x_i exp(G_i - R)) . (k_j exp(R - G_j)),  one matmul per block.
# Keys before R and rows after it get factors <= 1; an underflow there is harmless, as the true term
# is smaller still. Keys after R and rows before it get factors >= 1, which must not overflow.


def _scores_fast(q, k, sums):
    """R at each block's middle token, for all keys up to the block's end: needs |G_t - R| <= SAFE_EXPONENT."""
    return _split_decay_scores(q, k, sums, sums.from_middle, sums.head[..., _MIDDLE:_MIDDLE + 1, :], own_block=True)


def _scores_exact(q, k, sums):
    """For any g <= 0: R at each block's first token, so every factor is <= 1, for the keys of
    earlier blocks; within a block, exp(G_i - G_j) itself for every pair and channel."""
    kk, qk = _split_decay_scores(q, k, sums, sums.from_first, sums.head[..., :1, :], own_block=False)
    lead, dk = q.shape[:-2], q.shape[-1]
    rows = jnp.stack([k, q], axis=-3).reshape(*lead, 2, BLOCKS, BLOCK, dk)
    pair_sums = _einsum("ijs,...asc->...aijc", _PAIRS, sums.g)  # [..., a, i, j, K]
    causal = np.tri(BLOCK, dtype=bool)[:, :, None]  # [i, j, 1]: j <= i
    decayed_keys = jnp.exp(jnp.where(causal, pair_sums, -jnp.inf)) * k.reshape(*lead, BLOCKS, 1, BLOCK, dk)
    inside = _einsum("...xaic,...aijc->...xaij", rows, decayed_keys)  # [..., 2, a, i, j]
    inside = inside[..., :, :, None, :] * np.eye(BLOCKS, dtype=np.float32)[:, None, :, None]  # block diagonal
    inside = inside.reshape(*lead, 2, CHUNK, CHUNK)
    return kk + inside[..., 0, :, :], qk + inside[..., 1, :, :]


def _split_decay_scores(q, k, sums, from_ref, head_to_ref, own_block):
    """(kk, qk) [..., C, C] with R at the token where from_ref = G_t - R is 0; head_to_ref [..., BLOCKS, 1, K]
    is R - G_(block start - 1). Keys of the block itself only if own_block. Entries with j > i come
    out finite; the caller masks them."""
    lead, dk = q.shape[:-2], q.shape[-1]
    rows = jnp.stack([k, q], axis=-3) * _unblock(jnp.exp(from_ref))[..., None, :, :]
    # R_a - G_j for key j in block b < a: the rest of block b, the blocks between, block a up to R.
    earlier = sums.tail[..., None, :, :, :] + sums.between + head_to_ref[..., :, None, :, :]  # [..., a, b, j, K]
    a, b = np.arange(BLOCKS)[:, None, None, None], np.arange(BLOCKS)[None, :, None, None]
    exponent = jnp.where(b < a, earlier, -jnp.inf)
    if own_block:
        exponent = jnp.where(b == a, -from_ref[..., :, None, :, :], exponent)
    keys = k.reshape(*lead, 1, CHUNK, dk) * jnp.exp(exponent.reshape(*lead, BLOCKS, CHUNK, dk))
    scores = _einsum("...xaik,...ajk->...xaij", rows.reshape(*lead, 2, BLOCKS, BLOCK, dk), keys)
    scores = scores.reshape(*lead, 2, CHUNK, CHUNK)
    return scores[..., 0, :, :], scores[..., 1, :, :]


def _solve_unit_lower(a, rhs):
    """x with (I + a) x = rhs, a strictly lower [..., C, C]. The diagonal BLOCK blocks are inverted
    by forward substitution over their rows, then block forward substitution gives x (measured
    faster on CPU than lax.linalg.triangular_solve, which also kept LAPACK threads spinning)."""
    diagonal = jnp.stack([a[..., j * BLOCK:(j + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] for j in range(BLOCKS)],
                         axis=-3)

    def invert_row(r, inverse):  # row r of (I + d)^-1 is e_r - d[r] (I + d)^-1, its rows < r already done
        row = jax.nn.one_hot(r, BLOCK, dtype=a.dtype) - _einsum("...j,...jk->...k", diagonal[..., r, :], inverse)
        return inverse.at[..., r, :].set(row)

    inverse = jax.lax.fori_loop(0, BLOCK, invert_row, jnp.zeros_like(diagonal))
    parts = []
    for j in range(BLOCKS):
        block = rhs[..., j * BLOCK:(j + 1) * BLOCK, :]
        if j:
            earlier = jnp.concatenate(parts, axis=-2)
            block = block - _einsum("...ij,...jk->...ik", a[..., j * BLOCK:(j + 1) * BLOCK, :j * BLOCK], earlier)
        parts.append(_einsum("...ij,...jk->...ik", inverse[..., j, :, :], block))
    return jnp.concatenate(parts, axis=-2)
