"""Kimi Delta Attention layer (ARCHITECTURE.md, "KDA"): projections, short conv, gate, delta rule, gated norm."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.config import K3Config
from k3jax.layers.common import Linear, param, per_group, rms_norm
from pallas_kernels import kda as kda_ops
from pallas_kernels import kda_decode as kda_decode_ops
from sharding.mesh import DATA, MODEL


class KDACache(NamedTuple):
    """Per-sequence KDA state: the last conv_size-1 pre-conv q, k, v rows and the fp32 recurrent state.

    The conv window keeps q, k and v on their own axis so that its head-major channel axis P splits
    over tensor-parallel devices like the heads do (a flat q|k|v axis would not).
    """

    conv: jax.Array  # [B, conv_size - 1, 3 (q, k, v), P], activation dtype
    state: jax.Array  # [B, heads, head_dim (K), head_dim (V)], float32

    @staticmethod
    def zeros(cfg: K3Config, batch: int, dtype) -> "KDACache":
        p, d = cfg.kda_projection_size, cfg.kda_head_dim
        return KDACache(jnp.zeros((batch, cfg.kda_conv_size - 1, 3, p), dtype),
                        jnp.zeros((batch, cfg.kda_num_heads, d, d), jnp.float32))


class KDARecord(NamedTuple):
    """What a speculative verify step keeps of a KDA layer's window instead of writing its slots, so
    that `commit_record` can fold in exactly the accepted tokens afterwards (SGLang's ReplaySSM
    form: a few vectors per token, not a full state per window position)."""

    qkv: jax.Array  # [B, T, 3, P] pre-conv q, k, v rows (the conv window after the accepted tokens)
    k: jax.Array  # [B, T, heads, head_dim] post-conv keys
    v: jax.Array  # [B, T, heads, head_dim] post-conv values
    g: jax.Array  # [B, T, heads, head_dim] float32 log decay
    beta: jax.Array  # [B, T, heads] float32 write strength


class Recorded(NamedTuple):
    """A KDA layer's output in a verify step: its slot pool, untouched, and the window's record."""

    pool: KDACache
    record: KDARecord


class KimiDeltaAttention(nnx.Module):
    def __init__(self, cfg: K3Config, *, dtype, rngs):
        h, p, d, heads = cfg.hidden_size, cfg.kda_projection_size, cfg.kda_head_dim, cfg.kda_num_heads
        self.cfg = cfg
        self.q_proj = Linear(h, p, ("embed", "kda_heads"), dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, p, ("embed", "kda_heads"), dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, p, ("embed", "kda_heads"), dtype=dtype, rngs=rngs)
        if cfg.kda_full_rank_gate:
            self.g_proj = Linear(h, p, ("embed", "kda_heads"), dtype=dtype, rngs=rngs)
        else:
            self.g_a_proj = Linear(h, d, ("embed", "kda_rank"), dtype=dtype, rngs=rngs)
            self.g_b_proj = Linear(d, p, ("kda_rank", "kda_heads"), dtype=dtype, rngs=rngs)
        self.f_a_proj = Linear(h, d, ("embed", "kda_rank"), dtype=dtype, rngs=rngs)
        self.f_b_proj = Linear(d, p, ("kda_rank", "kda_heads"), dtype=dtype, rngs=rngs)
        self.b_proj = Linear(h, heads, ("embed", "kda_head_count"), dtype=dtype, rngs=rngs)
        conv_shape, conv_axes = (cfg.kda_conv_size, p), ("conv_tap", "kda_heads")
        self.q_conv1d = param(rngs, conv_shape, conv_axes, jnp.float32, stddev=0.5)
        self.k_conv1d = param(rngs, conv_shape, conv_axes, jnp.float32, stddev=0.5)
        self.v_conv1d = param(rngs, conv_shape, conv_axes, jnp.float32, stddev=0.5)
        # Gate parameters kept in fp32 as in the checkpoint. A_log: one entry per head (the
        # checkpoint may store more; only the first `heads` are used, as vLLM and SGLang do).
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, heads, dtype=jnp.float32)),
                               logical_axes=("kda_head_count",))
        self.dt_bias = param(None, (p,), ("kda_heads",), jnp.float32, init="zeros")
        self.o_norm = param(None, (d,), ("norm",), jnp.float32, init="ones")
        self.o_proj = Linear(p, h, ("kda_heads", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x, cache: KDACache | None, batch):
        """x [B, T, H]; batch: a `decoder.Batch` (valid tokens, lengths, and the slots of pooled caches).

        Returns (out [B, T, H], new cache or None). Padded tokens leave the state untouched. With
        `batch.slots`, `cache` is the slot pool: each row reads its slot (zeros when it starts a new
        sequence) and writes it back; padding rows use the null slot 0. With `batch.record` (a
        speculative verify) the pool is left as it is and the new cache is `Recorded(pool, record)`.
        """
        if batch.sequence_parallel:
            return self._forward_sequence_parallel(x, cache, batch.valid, batch.lengths)
        if batch.slots is None:
            return self._forward(x, cache, batch.valid, batch.lengths)
        if x.shape[1] == 1 and not batch.record:
            return self._decode_in_slots(x, cache, batch)
        fresh = batch.offsets == 0
        rows = per_group(lambda pools, slots: jax.tree.map(lambda pool: pool[slots], pools), batch.groups, cache,
                         batch.slots)
        rows = jax.tree.map(lambda r: jnp.where(fresh.reshape(-1, *(1,) * (r.ndim - 1)), 0, r).astype(r.dtype), rows)
        if batch.record:
            out, record = self._forward(x, rows, batch.valid, batch.lengths, record=True)
            return out, Recorded(cache, record)
        out, rows = self._forward(x, rows, batch.valid, batch.lengths)
        return out, per_group(lambda pools, slots, new: jax.tree.map(lambda pool, r: pool.at[slots].set(r), pools, new),
                              batch.groups, cache, batch.slots, rows)

    def _decode_in_slots(self, x, pool: KDACache, batch):
        """One token per row, the states updated in their slots by the decode op (a Pallas kernel on
        GPU that reads and writes each slot in place, instead of gathering the states and
        scattering them back). Rows without a token (padding) go to the null slot 0."""
        cfg = self.cfg
        b = x.shape[0]
        slots = jnp.where(batch.lengths > 0, batch.slots, 0)
        fresh = (batch.offsets == 0) & (slots > 0)
        # A sequence whose first token this is starts from zeros, not from what its slot held last.
        def zero(pools, ids):
            return jax.tree.map(lambda a: a.at[ids].set(0), pools)
        pool = jax.lax.cond(jnp.any(fresh), lambda p: per_group(zero, batch.groups, p, jnp.where(fresh, slots, 0)),
                            lambda p: p, pool)
        qkv = jnp.stack([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=2)  # [B, 1, 3, P]
        weight = jnp.stack([self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]], axis=1)  # [W, 3, P]
        f = self.f_b_proj(self.f_a_proj(x), jnp.float32)
        dt_bias, a_log = self.dt_bias[...], self.A_log[...]

        def decode(qkv, conv_pool, f, beta_logits, state_pool, slots):
            return kda_decode_ops.kda_decode(qkv, weight, conv_pool, f, dt_bias, a_log, beta_logits, state_pool, slots,
                                             gate_lower_bound=cfg.kda_gate_lower_bound)
        o, conv, state = per_group(decode, batch.groups, qkv, pool.conv, f, self.b_proj(x, jnp.float32), pool.state,
                                   slots)
        return self._gated_output(x, o.reshape(b, 1, cfg.kda_num_heads, cfg.kda_head_dim)), KDACache(conv, state)

    def _gated_output(self, x, o):
        """The gated output norm and o_proj of the attention output o [B, T, heads, head_dim]."""
        cfg = self.cfg
        b, t = x.shape[:2]
        gate = self.g_proj(x) if cfg.kda_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        gate = gate.reshape(b, t, cfg.kda_num_heads, cfg.kda_head_dim).astype(jnp.float32)
        y = rms_norm(o, self.o_norm[...], cfg.kda_output_norm_eps, jnp.float32) * jax.nn.sigmoid(gate)
        return self.o_proj(y.astype(x.dtype).reshape(b, t, -1))

    def _forward(self, x, cache: KDACache | None, valid, lengths, record: bool = False):
        cfg = self.cfg
        b, t, _ = x.shape
        heads, d = cfg.kda_num_heads, cfg.kda_head_dim
        qkv, weight, g, beta = self._token_inputs(x, valid)
        prev = cache.conv if cache is not None else jnp.zeros((b, cfg.kda_conv_size - 1, *qkv.shape[2:]), x.dtype)
        window = jnp.concatenate([prev.astype(x.dtype), qkv], axis=1)  # [B, W-1+T, 3, P]
        qkv = _causal_conv_silu(window, weight, t).astype(x.dtype)
        q, k, v = (qkv[:, :, i].reshape(b, t, heads, d) for i in range(3))
        initial = cache.state if cache is not None else None
        # A verify window runs token by token, as the plain decode it stands in for: the same
        # arithmetic, so speculation does not move the logits.
        kernel = kda_ops.fused_recurrent_kda if t == 1 or record else kda_ops.chunk_kda
        o, state = kernel(q, k, v, g, beta, initial_state=initial, output_final_state=cache is not None,
                          use_qk_l2norm_in_kernel=True)

        out = self._gated_output(x, o)
        if cache is None:
            return out, None
        if record:
            return out, KDARecord(window[:, cfg.kda_conv_size - 1:], k, v, g, beta)
        # The next call's conv window: the conv_size-1 rows ending at each sequence's last real token.
        rows = lengths[:, None] + jnp.arange(cfg.kda_conv_size - 1)[None, :]
        conv = jnp.take_along_axis(window, rows[:, :, None, None], axis=1)
        return out, KDACache(conv.astype(cache.conv.dtype), state)

    def _forward_sequence_parallel(self, x, cache: KDACache, valid, lengths):
        """`_forward` of a prompt whose tokens are split over `data` (k3jax/sequence_parallel.py): the
        projections, gate and output partition per token by themselves; the conv window and the
        recurrent state cross the shards in `_sequence_shard`, under shard_map, heads over `model`."""
        qkv, weight, g, beta = self._token_inputs(x, valid)
        channels, heads = P(None, None, None, MODEL), P(None, MODEL)
        shard = jax.shard_map(
            functools.partial(_sequence_shard, head_dim=self.cfg.kda_head_dim),
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(P(None, DATA, None, MODEL), P(None, None, MODEL), channels, P(None, DATA, MODEL),
                      P(None, DATA, MODEL), heads, P()),
            out_specs=(P(None, DATA, MODEL), channels, heads), check_vma=False)
        o, conv, state = shard(qkv, weight, cache.conv.astype(x.dtype), g, beta, cache.state, lengths)
        return self._gated_output(x, o.astype(x.dtype)), KDACache(conv.astype(cache.conv.dtype), state)

    def _token_inputs(self, x, valid):
        """What the recurrence takes of each token: the pre-conv qkv [B, T, 3, P], the conv weight
        [W, 3, P], g [B, T, heads, head_dim] and beta [B, T, heads] in fp32, zero at padding (no decay
        and no write)."""
        qkv = jnp.stack([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=2)
        weight = jnp.stack([self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]], axis=1)
        g = jnp.where(valid[:, :, None, None], self._log_decay(x), 0.0)
        beta = jnp.where(valid[:, :, None], jax.nn.sigmoid(self.b_proj(x, jnp.float32)), 0.0)
        return qkv, weight, g, beta

    def _log_decay(self, x):
        """Per-channel log decay g [B, T, heads, head_dim] in fp32 (always <= 0)."""
        cfg = self.cfg
        b, t, _ = x.shape
        f = self.f_b_proj(self.f_a_proj(x), jnp.float32) + self.dt_bias[...]
        f = f.reshape(b, t, cfg.kda_num_heads, cfg.kda_head_dim)
        a = jnp.exp(self.A_log[...])[:, None]  # [heads, 1]
        if cfg.kda_gate_lower_bound is not None:  # K3's "safe gate": g in (lower_bound, 0)
            return cfg.kda_gate_lower_bound * jax.nn.sigmoid(a * f)
        softplus = jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(jnp.minimum(f, 20.0))))  # Kimi Linear
        return -a * softplus


def commit_record(pool: KDACache, record: KDARecord, slots, accepted, targets=None) -> KDACache:
    """Writes into each row's slot the KDA state and conv window after its first `accepted` window
    tokens (int32 [B], 1..T; padding rows point at the null slot 0 and may hold anything). With
    `targets` ([B] slots) the results go there instead and `slots` are only read: a prefix-cache
    snapshot taken inside a window.

    The state replays the recorded recurrence from the slot's state with the tokens past `accepted`
    masked exactly as right padding is (no decay, no write): the recurrence of a plain decode of the
    accepted tokens. (Not bit for bit: the window's projections ran as one [T]-row matmul, whose
    blocking rounds differently from T one-row decodes, ~1e-7.) The conv window, pure data movement,
    is exact: the W-1 pre-conv rows ending at the last accepted token.
    """
    t = record.k.shape[1]
    keep = jnp.arange(t)[None, :] < accepted[:, None]
    g = jnp.where(keep[:, :, None, None], record.g, 0.0)
    beta = jnp.where(keep[:, :, None], record.beta, 0.0)
    _, state = kda_ops.fused_recurrent_kda(jnp.zeros_like(record.k), record.k, record.v, g, beta,
                                           initial_state=pool.state[slots], output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
    width = pool.conv.shape[1]
    window = jnp.concatenate([pool.conv[slots].astype(record.qkv.dtype), record.qkv], axis=1)
    rows = accepted[:, None] + jnp.arange(width)[None, :]
    conv = jnp.take_along_axis(window, rows[:, :, None, None], axis=1)
    targets = slots if targets is None else targets
    return KDACache(pool.conv.at[targets].set(conv.astype(pool.conv.dtype)), pool.state.at[targets].set(state))


def _sequence_shard(qkv, weight, prev, g, beta, state, lengths, *, head_dim: int):
    """One sequence shard of a KDA layer, inside shard_map (`data` and `model` manual): this shard's
    T_l tokens of pre-conv qkv [B, T_l, 3, P_l], g [B, T_l, H_l, K], beta [B, T_l, H_l]; the cache's
    conv window prev [B, W-1, 3, P_l] and state [B, H_l, K, V] (what precedes shard 0); lengths [B]
    real tokens of the whole prompt. Returns (o [B, T_l, H_l, V], the conv window and state after
    each sequence's last real token, the same on every shard)."""
    b, t, _, p = qkv.shape
    width = weight.shape[0] - 1
    shards, me = jax.lax.axis_size(DATA), jax.lax.axis_index(DATA)
    # The conv reads the previous shard's last W-1 inputs (the first shard: the cache's window).
    from_previous = jax.lax.ppermute(qkv[:, t - width:], DATA, [(j, j + 1) for j in range(shards - 1)])
    window = jnp.concatenate([jnp.where(me == 0, prev, from_previous), qkv], axis=1)  # [B, W-1+T_l, 3, P_l]
    q, k, v = (x.reshape(b, t, p // head_dim, head_dim)  # [B, T_l, H_l, K]
               for x in jnp.moveaxis(_causal_conv_silu(window, weight, t).astype(qkv.dtype), 2, 0))
    o, state = kda_ops.chunk_kda_sequence_parallel(q, k, v, g, beta, axis=DATA, initial_state=state,
                                                   use_qk_l2norm_in_kernel=True)
    # The new conv window: the W-1 rows of the whole prompt's window ending at its last real token,
    # rows lengths .. lengths + W-2 of it. Local row m is the whole window's row me * T_l + m; each
    # shard contributes the rows it owns (its tokens; the first shard also the cache's rows) and
    # the sum over shards puts every row together (adding zeros is exact).
    rows = lengths[:, None] + jnp.arange(width)[None, :] - me * t  # [B, W-1] local rows
    owned = (rows >= jnp.where(me == 0, 0, width)) & (rows < t + width)
    picked = jnp.take_along_axis(window, jnp.clip(rows, 0, t + width - 1)[:, :, None, None], axis=1)
    conv = jax.lax.psum(jnp.where(owned[:, :, None, None], picked, 0), DATA)
    return o, conv, state


def _causal_conv_silu(window, weight, t: int):
    """Depthwise causal conv + SiLU in fp32: out[t] = silu(sum_j weight[j] * window[t + j]).

    window [B, W-1+T, *C] (the previous W-1 inputs, then the T new ones); weight [W, *C], the last tap
    multiplying the current token.
    """
    w = weight.shape[0]
    window = window.astype(jnp.float32)
    acc = sum(window[:, j:j + t] * weight[j] for j in range(w))
    return jax.nn.silu(acc)
