"""MLA attention in XLA with a bounded working set: keys are visited in blocks with an online
softmax, so memory grows with the block size instead of the context length (1M-token contexts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mla import reference

KV_BLOCK = 1024
# Decode reads a query's keys in blocks of this many tokens. Smaller than prefill's: a block's work
# is one query's, so it is all memory traffic, and only whole blocks are read. Measured on 2 CPU
# cores (B = 16, 8 heads, 288-wide rows, fp32; per MLA layer): paged, context 130 in a 512-token
# table, 6.0 ms at 1024 and 2.0 at 256; context 4000, 91 ms and 46 (the smaller block stays in cache).
DECODE_KV_BLOCK = 256


def causal_attention(q, k, v, *, q_offset, kv_length, scale, kv_block: int = KV_BLOCK):
    """Same contract as reference.causal_attention."""
    if k.shape[1] <= kv_block:  # one block: the plain form is already optimal
        return reference.causal_attention(q, k, v, q_offset=q_offset, kv_length=kv_length, scale=scale)
    hi = _causal_limit(q_offset, kv_length, q.shape[1])
    out = _online_softmax(q, jnp.zeros_like(hi), hi, scale, _contiguous_blocks(k, v, kv_block), _head_scores,
                          _head_mix)
    return jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype)


def varlen_causal_attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, scale, kv_block: int = KV_BLOCK):
    """Same contract as reference.varlen_causal_attention: the padded form's blocks over the packed
    rows as one sequence, each query limited to its own sequence's keys."""
    lo, hi = reference.varlen_key_ranges(cu_seqlens_q, cu_seqlens_k, q.shape[0])
    if k.shape[0] <= kv_block:
        return reference.varlen_causal_attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                                 scale=scale)
    out = _online_softmax(q[None], lo[None], hi[None], scale, _contiguous_blocks(k[None], v[None], kv_block),
                          _head_scores, _head_mix)
    return jnp.transpose(out[0], (1, 0, 2)).astype(q.dtype)


def latent_decode_attention(q_latent, cache, *, kv_length, scale, value_width, kv_block: int = DECODE_KV_BLOCK):
    """Same contract as reference.latent_decode_attention."""
    if cache.shape[1] <= kv_block:
        return reference.latent_decode_attention(q_latent, cache, kv_length=kv_length, scale=scale,
                                                 value_width=value_width)
    out = _latent_attention(q_latent[:, None], kv_length[:, None], scale, value_width,
                            _contiguous_blocks(cache, cache, kv_block))
    return out[:, 0].astype(q_latent.dtype)


def paged_decode_attention(q_latent, pages, page_table, kv_length, *, scale, value_width, kv_scale=None,
                           kv_block: int = DECODE_KV_BLOCK):
    """Same contract as reference.paged_decode_attention: one query row at the end of each context."""
    out = paged_extend_attention(q_latent[:, None], pages, page_table, q_offset=kv_length - 1, kv_length=kv_length,
                                 scale=scale, value_width=value_width, kv_scale=kv_scale, kv_block=kv_block)
    return out[:, 0]


def paged_extend_attention(q_latent, pages, page_table, *, q_offset, kv_length, scale, value_width, kv_scale=None,
                           kv_block: int = DECODE_KV_BLOCK):
    """Same contract as reference.paged_extend_attention; gathers kv_block tokens of pages at a time,
    never the whole context. kv_scale is folded into the scale and the output (the rows stay stored)."""
    dequant = 1.0 if kv_scale is None else jnp.asarray(kv_scale, jnp.float32)
    blocks = _paged_blocks(pages, page_table, kv_length, kv_block, q_latent.dtype)
    hi = _causal_limit(q_offset, kv_length, q_latent.shape[1])
    out = _latent_attention(q_latent, hi, scale * dequant, value_width, _same(blocks))
    return (out * dequant).astype(q_latent.dtype)


def paged_prefill_attention(q, pages, page_table, w_uk, w_uv, *, q_offset, kv_length, scale, kv_scale=None,
                            kv_block: int = KV_BLOCK):
    """Same contract as reference.paged_prefill_attention; gathers kv_block tokens of pages at a time
    and expands them per head there, so the expanded keys and values never exceed one block (a
    chunk's cost follows its context, not the page table's width). kv_scale folds into the scale
    and the output: the expansion is linear in the rows."""
    dequant = 1.0 if kv_scale is None else jnp.asarray(kv_scale, jnp.float32)
    nope, latent_width = w_uk.shape[1], w_uk.shape[2]
    n_blocks, block_tokens, load_rows = _paged_blocks(pages, page_table, kv_length, kv_block, q.dtype)
    hi = _causal_limit(q_offset, kv_length, q.shape[1])

    def load(index):  # (keys [B, S, H, nope + rope], values [B, S, H, v])
        rows = load_rows(index)
        latent = rows[..., :latent_width]
        k_nope = jnp.einsum("bsc,hnc->bshn", latent, w_uk.astype(q.dtype), preferred_element_type=jnp.float32)
        v = jnp.einsum("bsc,hvc->bshv", latent, w_uv.astype(q.dtype), preferred_element_type=jnp.float32)
        # The shared key joins every head's keys: one dot per block (a separate dot for it measured 2-4x
        # slower on XLA:CPU).
        k_rope = jnp.broadcast_to(rows[:, :, None, latent_width:], (*k_nope.shape[:3], rows.shape[-1] - latent_width))
        return jnp.concatenate([k_nope.astype(q.dtype), k_rope], axis=-1), v.astype(q.dtype)

    out = _online_softmax(q, jnp.zeros_like(hi), hi, scale * dequant, (n_blocks, block_tokens, load), _head_scores,
                          _head_mix)
    return (jnp.transpose(out, (0, 2, 1, 3)) * dequant).astype(q.dtype)


def _head_scores(q_blk, k_blk):
    """Per-head queries [B, T, H, D] against keys [B, S, H, D] -> [B, H, T, S] fp32."""
    return jnp.einsum("bthd,bshd->bhts", q_blk, k_blk, preferred_element_type=jnp.float32)


def _head_mix(p, v_blk):
    """Weights [B, H, T, S] over per-head values [B, S, H, Dv] -> [B, H, T, Dv] fp32."""
    return jnp.einsum("bhts,bshd->bhtd", p, v_blk.astype(jnp.float32))


def _causal_limit(q_offset, kv_length, t: int):
    """[B, T]: query t of row b (position q_offset[b] + t) sees keys below this."""
    return jnp.minimum(q_offset[:, None] + jnp.arange(t)[None, :] + 1, kv_length[:, None])


def _paged_blocks(pages, page_table, kv_length, kv_block: int, dtype):
    """(number of blocks, tokens per block, load(index) -> stored rows [B, tokens, C] in dtype) over
    each row's pages, whole pages at a time; rows at or past the row's length read as zeros (unwritten
    rows may hold anything, NaN included)."""
    page_size = pages.shape[1]
    pages_per_block = min(max(1, kv_block // page_size), page_table.shape[1])
    table = jnp.pad(page_table, ((0, 0), (0, -page_table.shape[1] % pages_per_block)))  # pad with page 0
    table = table.reshape(table.shape[0], -1, pages_per_block)
    block_tokens = pages_per_block * page_size

    def load(index):
        rows = pages[table[:, index]].astype(dtype)
        rows = rows.reshape(rows.shape[0], block_tokens, rows.shape[-1])
        token = index * block_tokens + jnp.arange(block_tokens)
        return jnp.where((token[None, :] < kv_length[:, None])[..., None], rows, 0)

    return table.shape[1], block_tokens, load


def _same(blocks):
    """Blocks whose rows are both the keys and the values (the absorbed form)."""
    n_blocks, block_tokens, load = blocks

    def load_both(index):
        rows = load(index)
        return rows, rows

    return n_blocks, block_tokens, load_both


def _latent_attention(q_latent, hi, scale, value_width, blocks):
    """The absorbed form: q_latent [B, T, H, C], query t of row b seeing rows [0, hi[b, t]) ->
    [B, T, H, value_width] fp32 (the value is each row's first value_width entries)."""
    def scores(q_blk, k_blk):
        return jnp.einsum("bthc,bsc->bhts", q_blk, k_blk, preferred_element_type=jnp.float32)

    def mix(p, v_blk):
        return jnp.einsum("bhts,bsc->bhtc", p, v_blk[..., :value_width].astype(jnp.float32))

    out = _online_softmax(q_latent, jnp.zeros_like(hi), hi, scale, blocks, scores, mix)
    return jnp.transpose(out, (0, 2, 1, 3))


def _contiguous_blocks(k, v, kv_block):
    """(number of blocks, block size, load(index) -> (k block, v block)) over axis 1, zero padded."""
    n_blocks = -(-k.shape[1] // kv_block)

    def pad(x):
        return jnp.pad(x, [(0, 0), (0, n_blocks * kv_block - x.shape[1])] + [(0, 0)] * (x.ndim - 2))

    k, v = pad(k), pad(v)

    def load(index):
        start = index * kv_block
        return (jax.lax.dynamic_slice_in_dim(k, start, kv_block, axis=1),
                jax.lax.dynamic_slice_in_dim(v, start, kv_block, axis=1))

    return n_blocks, kv_block, load


def _online_softmax(q, lo, hi, scale, blocks, scores, mix):
    """Flash-attention recurrence over key blocks; query t of row b sees keys lo[b, t] <= s < hi[b, t].
    Returns [B, H, T, Dv] float32. Only the blocks up to the furthest key any query sees are visited:
    the serving engine's page tables span max_model_len, most of it unused by a short context."""
    n_blocks, kv_block, load = blocks
    b, t, h = q.shape[:3]
    dv = jax.eval_shape(lambda: mix(jnp.zeros((b, h, t, kv_block), jnp.float32), load(0)[1])).shape[-1]
    needed = jnp.clip((jnp.max(hi) + kv_block - 1) // kv_block, 0, n_blocks)

    def step(index, carry):
        peak, total, acc = carry
        k_blk, v_blk = load(index)
        s = index * kv_block + jnp.arange(kv_block)
        visible = (s[None, None, :] >= lo[:, :, None]) & (s[None, None, :] < hi[:, :, None])
        logits = jnp.where(visible[:, None], scores(q, k_blk) * scale, -jnp.inf)
        new_peak = jnp.maximum(peak, jnp.max(logits, axis=-1))
        safe_peak = jnp.where(jnp.isfinite(new_peak), new_peak, 0.0)
        p = jnp.exp(logits - safe_peak[..., None])
        rescale = jnp.exp(jnp.where(jnp.isfinite(peak), peak - safe_peak, -jnp.inf))
        total = total * rescale + jnp.sum(p, axis=-1)
        acc = acc * rescale[..., None] + mix(p, v_blk)
        return new_peak, total, acc

    init = (jnp.full((b, h, t), -jnp.inf, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
            jnp.zeros((b, h, t, dv), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, needed, step, init)
    return acc / jnp.where(total > 0, total, 1.0)[..., None]
