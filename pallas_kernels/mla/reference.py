"""Plain-softmax MLA attention: the obviously-correct oracle for the other implementations."""

from __future__ import annotations

import jax.numpy as jnp


def _allowed(t_q: int, s_kv: int, q_offset, kv_length):
    """[B, T, S] mask: key s is visible to query t iff s <= q_offset + t and s < kv_length."""
    q_pos = q_offset[:, None] + jnp.arange(t_q)[None, :]
    s = jnp.arange(s_kv)
    return (s[None, None, :] <= q_pos[:, :, None]) & (s[None, None, :] < kv_length[:, None, None])


def causal_attention(q, k, v, *, q_offset, kv_length, scale):
    """q [B, T, H, Dqk], k [B, S, H, Dqk], v [B, S, H, Dv] -> [B, T, H, Dv] (q's dtype)."""
    logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
    mask = _allowed(q.shape[1], k.shape[1], q_offset, kv_length)[:, None]
    probs = _masked_softmax(logits, mask)
    out = jnp.einsum("bhts,bshd->bthd", probs, v.astype(jnp.float32))
    return out.astype(q.dtype)


def varlen_causal_attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, scale):
    """Packed q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv]; sequence n owns query rows
    cu_seqlens_q[n]:cu_seqlens_q[n + 1] and key rows cu_seqlens_k[n]:cu_seqlens_k[n + 1], its queries
    being the last q_len of its k_len positions. Rows past the last sequence get zeros."""
    lo, hi = varlen_key_ranges(cu_seqlens_q, cu_seqlens_k, q.shape[0])
    s = jnp.arange(k.shape[0])
    mask = (s[None, :] >= lo[:, None]) & (s[None, :] < hi[:, None])
    logits = jnp.einsum("thd,shd->hts", q, k, preferred_element_type=jnp.float32) * scale
    probs = _masked_softmax(logits, mask[None])
    return jnp.einsum("hts,shd->thd", probs, v.astype(jnp.float32)).astype(q.dtype)


def varlen_key_ranges(cu_seqlens_q, cu_seqlens_k, total_q: int):
    """Per packed query row, the packed key rows [lo, hi) it sees (empty past the last sequence)."""
    row = jnp.arange(total_q)
    seq = jnp.searchsorted(cu_seqlens_q[1:], row, side="right")  # the sequence that owns each row
    in_batch = seq < cu_seqlens_q.shape[0] - 1
    seq = jnp.minimum(seq, cu_seqlens_q.shape[0] - 2)
    k_first, k_last = cu_seqlens_k[seq], cu_seqlens_k[seq + 1]
    position = (k_last - k_first) - (cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]) + row - cu_seqlens_q[seq]
    hi = jnp.where(in_batch, jnp.minimum(k_first + position + 1, k_last), k_first)
    return k_first, jnp.maximum(hi, k_first)


def paged_decode_attention(q_latent, pages, page_table, kv_length, *, scale, value_width, kv_scale=None):
    """Absorbed-form decode over a page pool: sequence b's row s is pages[page_table[b, s // page_size],
    s % page_size] (true value = stored * kv_scale), the first kv_length[b] rows valid."""
    cache = _gather_pages(pages, page_table, kv_length, kv_scale)
    out = latent_decode_attention(q_latent.astype(jnp.float32), cache, kv_length=kv_length, scale=scale,
                                  value_width=value_width)
    return out.astype(q_latent.dtype)


def paged_extend_attention(q_latent, pages, page_table, *, q_offset, kv_length, scale, value_width, kv_scale=None):
    """Absorbed form for T new tokens per sequence over a page pool: q_latent [B, T, H, C] at positions
    q_offset[b] + t, causal over the pool's first kv_length[b] rows (paged as in paged_decode_attention)
    -> [B, T, H, value_width] in q_latent's dtype."""
    cache = _gather_pages(pages, page_table, kv_length, kv_scale)
    logits = jnp.einsum("bthc,bsc->bhts", q_latent.astype(jnp.float32), cache) * scale
    mask = _allowed(q_latent.shape[1], cache.shape[1], q_offset, kv_length)[:, None]
    out = jnp.einsum("bhts,bsc->bthc", _masked_softmax(logits, mask), cache[..., :value_width])
    return out.astype(q_latent.dtype)


def paged_prefill_attention(q, pages, page_table, w_uk, w_uv, *, q_offset, kv_length, scale, kv_scale=None):
    """Naive form over a page pool: every row (paged as in paged_decode_attention) expanded per head by
    w_uk [H, nope, C_lat] into keys [k_nope | shared key] and by w_uv [H, v, C_lat] into values, then
    causal_attention of q [B, T, H, nope + rope] -> [B, T, H, v] in q's dtype."""
    cache = _gather_pages(pages, page_table, kv_length, kv_scale)
    latent, k_rope = cache[..., :w_uk.shape[2]], cache[..., w_uk.shape[2]:]
    k_nope = jnp.einsum("bsc,hnc->bshn", latent, w_uk.astype(jnp.float32))
    k_rope = jnp.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:3], k_rope.shape[-1]))
    v = jnp.einsum("bsc,hvc->bshv", latent, w_uv.astype(jnp.float32))
    out = causal_attention(q.astype(jnp.float32), jnp.concatenate([k_nope, k_rope], axis=-1), v, q_offset=q_offset,
                           kv_length=kv_length, scale=scale)
    return out.astype(q.dtype)


def _gather_pages(pages, page_table, kv_length, kv_scale):
    """Each sequence's true rows [B, max_pages * page_size, C] in fp32, zeros from its length on (rows
    past the length may hold anything, NaN included)."""
    rows = pages.astype(jnp.float32) * (1.0 if kv_scale is None else kv_scale)
    cache = rows[page_table].reshape(page_table.shape[0], -1, pages.shape[-1])
    valid = jnp.arange(cache.shape[1])[None, :] < kv_length[:, None]
    return jnp.where(valid[..., None], cache, 0.0)


def latent_decode_attention(q_latent, cache, *, kv_length, scale, value_width):
    """Absorbed-form decode: q_latent [B, H, C] against cache [B, S, C] (C = latent + shared key).

    The value is the first `value_width` entries of each cache row (the normalised latent).
    Returns [B, H, value_width] in q_latent's dtype.
    """
    logits = jnp.einsum("bhc,bsc->bhs", q_latent, cache, preferred_element_type=jnp.float32) * scale
    mask = (jnp.arange(cache.shape[1])[None, :] < kv_length[:, None])[:, None, :]
    probs = _masked_softmax(logits, mask)
    out = jnp.einsum("bhs,bsc->bhc", probs, cache[..., :value_width].astype(jnp.float32))
    return out.astype(q_latent.dtype)


def _masked_softmax(logits, mask):
    logits = jnp.where(mask, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)  # rows with no visible key give zeros, not NaN
    weights = jnp.where(mask, jnp.exp(logits - peak), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.where(total > 0, total, 1.0)
