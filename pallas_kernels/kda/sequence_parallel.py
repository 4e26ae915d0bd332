"""KDA prefill with the sequence split over a mesh axis: the cross-shard state pass.

Called inside `shard_map` with `axis` manual: each shard holds T_l consecutive tokens of every
sequence, shard i the i-th span. Per head, a span's effect on the state is affine in the state it
starts from, S_in [K, V]:
    S_t = M_t S_in + C_t,    o_t = S_t^T (scale q_t) = S_in^T (M_t^T scale q_t) + o0_t
where M_t [K, K] is the product of the token maps (I - beta k k^T) diag(exp g) and C_t, o0_t are
the state and output of a zero start. The columns of the state evolve independently, so one chunked
run over the widened values [v | 0_K] from the widened state [S0 | I_K] gives both parts at once:
its first V columns are (C, o0) and its last K are (M, M^T scale q), the span's summary. The shards
exchange their (M_T, C_T) summaries (an all_gather of [K, K + V] per head), each folds those before
it in order, S <- M_j S + C_j from the initial state (a sequential pass: shard counts are small),
and adds its true incoming state's part to its outputs: no second run over the tokens.

The widened run is K + V wide: 2K in every KDA config (K = V = head_dim), a power of two wherever K
is, so it suits the Pallas kernels as the plain run does (impl="pallas" refuses other widths).

The maps M_t contract (beta in (0, 1), k normalised), so the summary is as well conditioned as the
state itself; the result equals the unsplit chunked run to fp32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda.api import chunk_kda

_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def chunk_kda_sequence_parallel(q, k, v, g, beta, *, axis: str, initial_state=None, scale=None,
                                use_qk_l2norm_in_kernel=False, impl="auto"):
    """This shard's span of the sequences, in `chunk_kda`'s contract: q, k, g [B, T_l, H, K],
    v [B, T_l, H, V], beta [B, T_l, H]; initial_state fp32 [B, H, K, V], the state before the
    first shard (None: zeros). Returns (o fp32 [B, T_l, H, V], the state after the last shard's
    span, fp32 [B, H, K, V], the same on every shard)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if initial_state is None:
        initial_state = jnp.zeros((b, h, dk, dv), jnp.float32)
    o_zero, o_map, transition, contribution = shard_summary(q, k, v, g, beta, scale=scale,
                                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                            impl=impl)
    incoming, final = incoming_states(transition, contribution, initial_state, axis)
    return o_zero + _einsum("bthk,bhkv->bthv", o_map, incoming), final


def shard_summary(q, k, v, g, beta, *, scale=None, use_qk_l2norm_in_kernel=False, impl="auto"):
    """The span's affine summary from one chunked run over the widened values: (o0 [B, T_l, H, V],
    M_t^T scale q_t [B, T_l, H, K], transition M [B, H, K, K], contribution C [B, H, K, V]), fp32."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    # fp32 values, so the two parts of o come back unrounded (chunk_kda returns o in v's dtype).
    wide_v = jnp.concatenate([v.astype(jnp.float32), jnp.zeros((b, t, h, dk), jnp.float32)], axis=-1)
    start = jnp.concatenate([jnp.zeros((b, h, dk, dv), jnp.float32),
                             jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, h, dk, dk))], axis=-1)
    o, end = chunk_kda(q, k, wide_v, g, beta, scale=scale, initial_state=start, output_final_state=True,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, impl=impl)
    return o[..., :dv], o[..., dv:], end[..., dv:], end[..., :dv]


def incoming_states(transition, contribution, initial_state, axis: str):
    """(the state entering this shard's span, the state after the last span), both [B, H, K, V]:
    every shard folds the gathered summaries of all shards in order, S <- M_j S + C_j."""
    transitions = jax.lax.all_gather(transition, axis)  # [n, B, H, K, K]
    contributions = jax.lax.all_gather(contribution, axis)  # [n, B, H, K, V]
    me = jax.lax.axis_index(axis)
    state, incoming = initial_state, initial_state
    for j in range(transitions.shape[0]):
        incoming = jnp.where(me == j, state, incoming)
        state = _einsum("bhij,bhjv->bhiv", transitions[j], state) + contributions[j]
    return incoming, state
