"""Gated Multi-head Latent Attention (ARCHITECTURE.md, "Gated MLA"): NoPE by default, sigmoid output gate.

A prefill uses the naive form (keys and values expanded per head from the latent); decode uses the
absorbed form straight over the latent cache of [normalised latent | shared key] rows. Over the
serving engine's pages, a step of a few tokens per row (a speculative verify window) uses the
absorbed form too, a long chunk the naive form expanded a block of pages at a time
(`absorbed_is_cheaper`). The DSpark draft's attention is this layer too (RoPE, no gate), with
`attend_block` for its block of rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.config import K3Config
from k3jax.layers.common import Linear, RMSNorm, per_group
from pallas_kernels import mla as mla_ops
from sharding.mesh import DATA, MODEL

FOLD_ROWS = 128  # query rows (block rows x heads) per paged attention call in `attend_block`


class MLACache(NamedTuple):
    """Contiguous latent cache per sequence (paging is the serving engine's business)."""

    latent: jax.Array  # [B, max_len, kv_lora_rank + qk_rope_head_dim]

    @staticmethod
    def zeros(cfg: K3Config, batch: int, max_len: int, dtype) -> "MLACache":
        return MLACache(jnp.zeros((batch, max_len, cfg.mla_cache_width), dtype))


class MLAPages(NamedTuple):
    """The serving engine's page pool of one MLA layer: rows of [normalised latent | shared key].

    Stored in bf16 (scale 1) or fp8 E4M3, where a stored value times `scale` is the true value. Page 0
    is the null page: padding tokens write there and nothing reads it as data.
    """

    pages: jax.Array  # [num_pages, page_size, kv_lora_rank + qk_rope_head_dim]
    scale: jax.Array  # float32 scalar

    @staticmethod
    def zeros(cfg: K3Config, num_pages: int, page_size: int, dtype, scale: float = 1.0) -> "MLAPages":
        return MLAPages(jnp.zeros((num_pages, page_size, cfg.mla_cache_width), dtype), jnp.float32(scale))

    def stored(self, values):
        """Cache rows as this pool stores them. Into fp8 pages values beyond the format's range are
        clamped to it (a plain cast would make them NaN), as vLLM does."""
        stored = values.astype(jnp.float32) / self.scale
        if jnp.issubdtype(self.pages.dtype, jnp.floating) and jnp.finfo(self.pages.dtype).bits == 8:
            limit = float(jnp.finfo(self.pages.dtype).max)
            stored = jnp.clip(stored, -limit, limit)
        return stored.astype(self.pages.dtype)

    def write(self, page_ids, rows_in_page, values, groups: int = 1) -> "MLAPages":
        """Stores values [B, T, C] at (page_ids, rows_in_page) [B, T] (`groups`: DP attention's blocks,
        `per_group`), as `stored`."""
        stored = self.stored(values)
        # The barrier makes every read of the pool read the written pool: without it XLA fuses the
        # write into the attention's gather of the old pool and copies the whole pool (twice, on
        # XLA:CPU) to keep both versions, every step.
        pages = per_group(lambda pool, ids, rows, x: pool.at[ids, rows].set(x), groups, self.pages, page_ids,
                          rows_in_page, stored)
        return self._replace(pages=jax.lax.optimization_barrier(pages))


class MultiHeadLatentAttention(nnx.Module):
    """cfg: a K3Config, or the DSpark draft's DSparkConfig (which has the same MLA fields)."""

    def __init__(self, cfg: K3Config, *, dtype, rngs):
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, ("embed", "q_lora"), dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, ("q_lora", "heads"),
                                   dtype=dtype, rngs=rngs)
        else:
            self.q_proj = Linear(h, heads * cfg.qk_head_dim, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(h, cfg.mla_cache_width, ("embed", "kv_latent"), dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                ("kv_lora", "heads"), dtype=dtype, rngs=rngs)
        if cfg.mla_use_output_gate:
            self.g_proj = Linear(h, heads * cfg.v_head_dim, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(heads * cfg.v_head_dim, h, ("heads", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x, cache: MLACache | MLAPages | None, batch):
        """x [B, T, H] holds positions offsets[b] + t; the cache (if any) holds the offsets[b] before.
        batch: a `decoder.Batch` (offsets, valid tokens, and the page table of pooled caches).

        Returns (out [B, T, H], new cache or None). Right padding needs no mask in attention: padded
        positions sit after every real one, so causality hides them. In a contiguous cache their rows
        are overwritten later; in pages they go to the null page, since a page may be shared.
        """
        if batch.sequence_parallel:
            return self._prefill_sequence_parallel(x, cache, batch.lengths)
        cfg = self.cfg
        b, t, _ = x.shape
        offsets = batch.offsets
        positions = offsets[:, None] + jnp.arange(t)[None, :]
        q_nope, q_rope = self.queries(x, positions)
        new_rows = self.cache_rows(x, positions)  # [B, T, C]
        scale = cfg.qk_head_dim ** -0.5

        if cache is None:
            o = self._naive(q_nope, q_rope, new_rows, jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32), scale)
        else:
            if isinstance(cache, MLAPages):
                cache = cache.write(*page_slots(batch.page_table, positions, cache.pages.shape[1], batch.valid),
                                    new_rows, batch.groups)
                o = self._paged(q_nope, q_rope, cache, batch, scale)
            else:
                latent = cache.latent.at[jnp.arange(b)[:, None], positions].set(new_rows.astype(cache.latent.dtype),
                                                                                mode="drop")
                cache = MLACache(latent)

                def attend(q_full):
                    return mla_ops.latent_decode_attention(q_full, latent.astype(q_full.dtype), kv_length=offsets + 1,
                                                           scale=scale, value_width=cfg.kv_lora_rank)
                if t == 1:
                    o = self._absorbed(q_nope[:, 0], q_rope[:, 0], attend)[:, None]
                else:  # a chunk after cached tokens: the naive form over the whole contiguous cache
                    o = self._naive(q_nope, q_rope, latent, offsets, offsets + t, scale)
        return self._output(x, o), cache

    def _paged(self, q_nope, q_rope, pages: MLAPages, batch, scale):
        """Attention of T new tokens per row over the page pool (their rows written), read in place
        through the page table, visiting only the pages up to each row's length. The absorbed form
        (queries into the latent space) where it does fewer multiply-adds than the naive form
        (every row expanded per head), as in `absorbed_is_cheaper`; a decode step always."""
        cfg = self.cfg
        t = q_nope.shape[1]
        offsets, table, groups = batch.offsets, batch.page_table, batch.groups
        ends = offsets + batch.lengths  # a padding position's page slot was not written: no query sees it
        if absorbed_is_cheaper(cfg, t):
            def attend(q_full):  # [B, T, heads, C] -> [B, T, heads, kv_lora_rank]
                read = functools.partial(mla_ops.paged_extend_attention, scale=scale, value_width=cfg.kv_lora_rank,
                                         kv_scale=pages.scale)
                return per_group(lambda q, pool, ids, start, end: read(q, pool, ids, q_offset=start, kv_length=end),
                                 groups, q_full, pages.pages, table, offsets, ends)
            return self._absorbed(q_nope, q_rope, attend)
        w_uk, w_uv = self._up_weights()
        read = functools.partial(mla_ops.paged_prefill_attention, scale=scale, kv_scale=pages.scale)
        return per_group(lambda q, pool, ids, start, end: read(q, pool, ids, w_uk, w_uv, q_offset=start, kv_length=end),
                         groups, jnp.concatenate([q_nope, q_rope], axis=-1), pages.pages, table, offsets, ends)

    def _prefill_sequence_parallel(self, x, cache: MLACache, lengths):
        """A fresh prefill whose tokens are split over `data` (k3jax/sequence_parallel.py): each shard
        computes its queries and cache rows; the rows (the compressed latent, 576 wide at K3 size, not
        the per-head keys and values) are all-gathered over `data` in `_attend_shard`, which expands
        them for its heads and attends causally. The new cache is exactly the new rows."""
        cfg = self.cfg
        b, t, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
        q_nope, q_rope = self.queries(x, positions)
        rows = self.cache_rows(x, positions)  # [B, T, C]
        w_uk, w_uv = self._up_weights()
        heads = P(None, DATA, MODEL)
        attend = jax.shard_map(
            functools.partial(_attend_shard, kv_lora_rank=cfg.kv_lora_rank, scale=cfg.qk_head_dim ** -0.5),
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(heads, heads, P(None, DATA), P(MODEL), P(MODEL), P()), out_specs=heads,
            check_vma=False)
        o = attend(q_nope, q_rope, rows, w_uk, w_uv, lengths)
        return self._output(x, o), MLACache(rows.astype(cache.latent.dtype))

    def queries(self, x, positions):
        """x [B, T, H] at positions [B, T] -> (q_nope [B, T, heads, nope], q_rope [B, T, heads, rope])."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank else self.q_proj(x)
        q = q.reshape(b, t, cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_rope = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        if not cfg.mla_use_nope:
            q_rope = rope_interleaved(q_rope, positions[:, :, None], cfg.rope_theta)
        return q_nope, q_rope

    def cache_rows(self, x, positions):
        """x [B, T, H] at positions [B, T] -> its cache rows [B, T, C]: [normalised latent | shared key]."""
        cfg = self.cfg
        kv = self.kv_a_proj_with_mqa(x)
        latent, k_rope = self.kv_a_layernorm(kv[..., :cfg.kv_lora_rank]), kv[..., cfg.kv_lora_rank:]
        if not cfg.mla_use_nope:
            k_rope = rope_interleaved(k_rope, positions, cfg.rope_theta)
        return jnp.concatenate([latent, k_rope], axis=-1)

    def attend_block(self, x, positions, pages: MLAPages, page_table, kv_length):
        """x [B, T, H] at positions [B, T] as one non-causal block (the DSpark draft's): every row attends
        to the same keys, the first kv_length[b] rows of the paged pool (the block's own rows written).

        Absorbed form. Since the keys are shared, groups of rows fold into the head axis of one paged
        decode call, at most FOLD_ROWS query rows per call (the kernel pads them to a power of two and
        holds them at once); further groups repeat the row's page table as extra batch rows.
        """
        cfg = self.cfg
        b, t, _ = x.shape
        heads = cfg.num_attention_heads
        per_group = max(1, min(t, FOLD_ROWS // heads))
        groups = -(-t // per_group)

        def attend(q_full):  # [B, T, heads, C] -> [B, T, heads, kv_lora_rank]
            q = jnp.pad(q_full, ((0, 0), (0, groups * per_group - t), (0, 0), (0, 0)))
            out = mla_ops.paged_decode_attention(q.reshape(b * groups, per_group * heads, q.shape[-1]), pages.pages,
                                                 jnp.repeat(page_table, groups, axis=0),
                                                 jnp.repeat(kv_length, groups), scale=cfg.qk_head_dim ** -0.5,
                                                 value_width=cfg.kv_lora_rank, kv_scale=pages.scale)
            return out.reshape(b, groups * per_group, heads, cfg.kv_lora_rank)[:, :t]

        return self._output(x, self._absorbed(*self.queries(x, positions), attend))

    def _output(self, x, o):
        """The heads' values o [B, T, heads, v] -> [B, T, H]: the output gate (if any), then o_proj."""
        b, t, _ = x.shape
        o = o.reshape(b, t, -1)
        if self.cfg.mla_use_output_gate:
            o = (o * jax.nn.sigmoid(self.g_proj(x))).astype(x.dtype)
        return self.o_proj(o)

    def _up_weights(self):
        """kv_b_proj [heads * (nope + v), C_lat] split per head: W_UK [heads, nope, C_lat] and
        W_UV [heads, v, C_lat]."""
        cfg = self.cfg
        w = self.kv_b_proj.kernel[...].reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                               cfg.kv_lora_rank)
        return w[:, :cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    def _naive(self, q_nope, q_rope, rows, q_offset, kv_length, scale):
        return _naive_attention(q_nope, q_rope, rows, *self._up_weights(), q_offset, kv_length, scale,
                                self.cfg.kv_lora_rank)

    def _absorbed(self, q_nope, q_rope, attend):
        """q_nope [..., heads, nope], q_rope [..., heads, rope] -> [..., heads, v]: the query mapped into
        the latent space, `attend` (latent queries -> attention-weighted latent rows), then W_UV."""
        w_uk, w_uv = self._up_weights()
        # weight first: XLA:CPU runs the other operand order as a bf16 DotThunk, which it does not support
        q_latent = jnp.einsum("hnc,...hn->...hc", w_uk.astype(q_nope.dtype), q_nope,
                              preferred_element_type=jnp.float32).astype(q_nope.dtype)
        out_latent = attend(jnp.concatenate([q_latent, q_rope], axis=-1))
        return jnp.einsum("...hc,hvc->...hv", out_latent, w_uv.astype(out_latent.dtype),
                          preferred_element_type=jnp.float32).astype(q_nope.dtype)


def absorbed_is_cheaper(cfg: K3Config, t: int) -> bool:
    """Whether T new tokens per row attend over cached rows in fewer multiply-adds, per row and head,
    in the absorbed form, T (C + C_lat) (scores against the C-wide row, the latent mix), than in the
    naive form, C_lat (nope + v) (the row expanded) + T (nope + rope + v). K3: T <= 170; k3-tiny: T <= 32.
    The count holds on 2 CPU cores (context 4K, fp32, 8 heads, xla paths): at K3's sizes the two forms
    took 55 and 53 ms at T = 128, and the naive form 71 against 106 at T = 256; at k3-tiny's, 3.1
    against 2.7 ms at T = 16 and 6.1 against 9.7 at T = 64."""
    latent, nope, rope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return t * (latent + rope + latent) <= latent * (nope + v) + t * (nope + rope + v)


def _naive_attention(q_nope, q_rope, rows, w_uk, w_uv, q_offset, kv_length, scale, kv_lora_rank: int):
    """The naive form: cache rows [B, S, C] expanded per head by W_UK [heads, nope, C_lat] and
    W_UV [heads, v, C_lat] into keys and values, then causal attention of q [B, T, heads, *] at
    positions q_offset[b] + t over the first kv_length[b] rows -> [B, T, heads, v]."""
    latent, k_rope = rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]
    latent = latent.astype(q_nope.dtype)
    k_nope = jnp.einsum("bsc,hnc->bshn", latent, w_uk.astype(latent.dtype),
                        preferred_element_type=jnp.float32).astype(q_nope.dtype)
    v = jnp.einsum("bsc,hvc->bshv", latent, w_uv.astype(latent.dtype),
                   preferred_element_type=jnp.float32).astype(q_nope.dtype)
    k_rope = jnp.broadcast_to(k_rope[:, :, None].astype(q_nope.dtype), (*k_nope.shape[:3], k_rope.shape[-1]))
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    return mla_ops.causal_attention(q, k, v, q_offset=q_offset, kv_length=kv_length, scale=scale)


def _attend_shard(q_nope, q_rope, rows, w_uk, w_uv, lengths, *, kv_lora_rank: int, scale):
    """One sequence shard's attention, inside shard_map (`data` and `model` manual): its T_l queries
    [B, T_l, H_l, *] at positions me * T_l + t against every shard's cache rows [B, T_l, C], gathered
    into the whole prompt's [B, T, C]; only its heads' W_UK, W_UV. Returns [B, T_l, H_l, v]."""
    b, t = q_nope.shape[:2]
    every_row = jax.lax.all_gather(rows, DATA, axis=1, tiled=True)
    start = jnp.full((b,), jax.lax.axis_index(DATA) * t, jnp.int32)
    return _naive_attention(q_nope, q_rope, every_row, w_uk, w_uv, start, lengths, scale, kv_lora_rank)


def page_slots(page_table, positions, page_size: int, valid):
    """(page id, row in page) [B, T] of positions [B, T] through page_table [B, max_pages]; where `valid`
    is False, the null page 0 (padding must not write into a page another sequence may share)."""
    max_pages = page_table.shape[1]
    page_ids = jnp.take_along_axis(page_table, jnp.minimum(positions // page_size, max_pages - 1), axis=1)
    return jnp.where(valid, page_ids, 0), positions % page_size


def rope_interleaved(x, positions, theta: float):
    """Rotary embedding on adjacent pairs (x[2i], x[2i+1]) as DeepSeek's MLA uses (vLLM is_neox_style=False).

    x [..., D] with D even; positions broadcastable to x.shape[:-1].
    """
    d = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x32 = x.astype(jnp.float32)
    even, odd = x32[..., 0::2], x32[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)
