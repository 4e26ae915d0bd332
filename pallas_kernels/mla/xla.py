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
    q_pos = q_offset[:, None] + jnp.arange(q.shape[1])[None, :]  # [B, T]
    hi = jnp.minimum(q_pos + 1, kv_length[:, None])

    def scores(q_blk, k_blk):
        return jnp.einsum("bthd,bshd->bhts", q_blk, k_blk, preferred_element_type=jnp.float32)

    def mix(p, v_blk):
        return jnp.einsum("bhts,bshd->bhtd", p, v_blk.astype(jnp.float32))

    out = _online_softmax(q, jnp.zeros_like(hi), hi, scale, _contiguous_blocks(k, v, kv_block), scores, mix)
    return jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype)


def varlen_causal_attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, scale, kv_block: int = KV_BLOCK):
    """Same contract as reference.varlen_causal_attention: the padded form's blocks over the packed
    rows as one sequence, each query limited to its own sequence's keys."""
    lo, hi = reference.varlen_key_ranges(cu_seqlens_q, cu_seqlens_k, q.shape[0])
    if k.shape[0] <= kv_block:
        return reference.varlen_causal_attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                                 scale=scale)

    def scores(q_blk, k_blk):
        return jnp.einsum("bthd,bshd->bhts", q_blk, k_blk, preferred_element_type=jnp.float32)

    def mix(p, v_blk):
        return jnp.einsum("bhts,bshd->bhtd", p, v_blk.astype(jnp.float32))

    out = _online_softmax(q[None], lo[None], hi[None], scale, _contiguous_blocks(k[None], v[None], kv_block),
                          scores, mix)
    return jnp.transpose(out[0], (1, 0, 2)).astype(q.dtype)


def latent_decode_attention(q_latent, cache, *, kv_length, scale, value_width, kv_block: int = DECODE_KV_BLOCK):
    """Same contract as reference.latent_decode_attention."""
    if cache.shape[1] <= kv_block:
        return reference.latent_decode_attention(q_latent, cache, kv_length=kv_length, scale=scale,
                                                 value_width=value_width)
    blocks = _contiguous_blocks(cache, cache, kv_block)
    return _latent_decode(q_latent, kv_length, scale, value_width, blocks).astype(q_latent.dtype)


def paged_decode_attention(q_latent, pages, page_table, kv_length, *, scale, value_width, kv_scale=None,
                           kv_block: int = DECODE_KV_BLOCK):
    """Same contract as reference.paged_decode_attention; gathers kv_block tokens of pages at a time,
    never the whole context."""
    page_size = pages.shape[1]
    pages_per_block = min(max(1, kv_block // page_size), page_table.shape[1])
    table = jnp.pad(page_table, ((0, 0), (0, -page_table.shape[1] % pages_per_block)))  # pad with page 0
    table = table.reshape(table.shape[0], -1, pages_per_block)
    dequant = 1.0 if kv_scale is None else jnp.asarray(kv_scale, jnp.float32)

    def load(index):  # fp8 pages are widened to q's dtype; kv_scale is folded into scale and output
        rows = pages[table[:, index]].astype(q_latent.dtype)
        rows = rows.reshape(rows.shape[0], -1, rows.shape[-1])
        token = index * rows.shape[1] + jnp.arange(rows.shape[1])
        rows = jnp.where((token[None, :] < kv_length[:, None])[..., None], rows, 0)  # unwritten rows may be NaN
        return rows, rows

    blocks = (table.shape[1], pages_per_block * page_size, load)
    out = _latent_decode(q_latent, kv_length, scale * dequant, value_width, blocks)
    return (out * dequant).astype(q_latent.dtype)


def _latent_decode(q_latent, kv_length, scale, value_width, blocks):
    """[B, H, value_width] fp32: every query sees rows [0, kv_length)."""
    hi = kv_length[:, None]

    def scores(q_blk, k_blk):
        return jnp.einsum("bthc,bsc->bhts", q_blk, k_blk, preferred_element_type=jnp.float32)

    def mix(p, v_blk):
        return jnp.einsum("bhts,bsc->bhtc", p, v_blk[..., :value_width].astype(jnp.float32))

    out = _online_softmax(q_latent[:, None], jnp.zeros_like(hi), hi, scale, blocks, scores, mix)
    return out[:, :, 0]


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
