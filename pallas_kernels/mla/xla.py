"""MLA attention in XLA with a bounded working set: keys are visited in blocks with an online
softmax, so memory grows with the block size instead of the context length (1M-token contexts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mla import reference

KV_BLOCK = 1024


def causal_attention(q, k, v, *, q_offset, kv_length, scale, kv_block: int = KV_BLOCK):
    """Same contract as reference.causal_attention."""
    if k.shape[1] <= kv_block:  # one block: the plain form is already optimal
        return reference.causal_attention(q, k, v, q_offset=q_offset, kv_length=kv_length, scale=scale)
    q_pos = q_offset[:, None] + jnp.arange(q.shape[1])[None, :]  # [B, T]

    def scores(q_blk, k_blk):
        return jnp.einsum("bthd,bshd->bhts", q_blk, k_blk, preferred_element_type=jnp.float32)

    def mix(p, v_blk):
        return jnp.einsum("bhts,bshd->bhtd", p, v_blk.astype(jnp.float32))

    out = _online_softmax(q, k, v, q_pos, kv_length, scale, kv_block, scores, mix)
    return jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype)


def latent_decode_attention(q_latent, cache, *, kv_length, scale, value_width, kv_block: int = KV_BLOCK):
    """Same contract as reference.latent_decode_attention."""
    if cache.shape[1] <= kv_block:
        return reference.latent_decode_attention(q_latent, cache, kv_length=kv_length, scale=scale,
                                                 value_width=value_width)
    q = q_latent[:, None]  # [B, 1, H, C]
    q_pos = jnp.full((q.shape[0], 1), jnp.iinfo(jnp.int32).max // 2, jnp.int32)  # only kv_length masks

    def scores(q_blk, k_blk):
        return jnp.einsum("bthc,bsc->bhts", q_blk, k_blk, preferred_element_type=jnp.float32)

    def mix(p, v_blk):
        return jnp.einsum("bhts,bsc->bhtc", p, v_blk[..., :value_width].astype(jnp.float32))

    out = _online_softmax(q, cache, cache, q_pos, kv_length, scale, kv_block, scores, mix)
    return out[:, :, 0].astype(q_latent.dtype)


def _online_softmax(q, k, v, q_pos, kv_length, scale, kv_block, scores, mix):
    """Flash-attention recurrence over key blocks; returns [B, H, T, Dv] float32."""
    s_total = k.shape[1]
    n_blocks = -(-s_total // kv_block)
    pad = n_blocks * kv_block - s_total
    k = jnp.pad(k, [(0, 0), (0, pad)] + [(0, 0)] * (k.ndim - 2))
    v = jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
    k_blocks = jnp.moveaxis(k.reshape(k.shape[0], n_blocks, kv_block, *k.shape[2:]), 1, 0)
    v_blocks = jnp.moveaxis(v.reshape(v.shape[0], n_blocks, kv_block, *v.shape[2:]), 1, 0)
    b, t, h = q.shape[:3]
    dv = mix(jnp.zeros((b, h, t, 1), jnp.float32), v_blocks[0][:, :1]).shape[-1]

    def step(carry, xs):
        peak, total, acc = carry
        index, k_blk, v_blk = xs
        s = index * kv_block + jnp.arange(kv_block)
        visible = (s[None, None, :] <= q_pos[:, :, None]) & (s[None, None, :] < kv_length[:, None, None])
        logits = jnp.where(visible[:, None], scores(q, k_blk) * scale, -jnp.inf)
        new_peak = jnp.maximum(peak, jnp.max(logits, axis=-1))
        safe_peak = jnp.where(jnp.isfinite(new_peak), new_peak, 0.0)
        p = jnp.exp(logits - safe_peak[..., None])
        rescale = jnp.exp(jnp.where(jnp.isfinite(peak), peak - safe_peak, -jnp.inf))
        total = total * rescale + jnp.sum(p, axis=-1)
        acc = acc * rescale[..., None] + mix(p, v_blk)
        return (new_peak, total, acc), None

    init = (jnp.full((b, h, t), -jnp.inf, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
            jnp.zeros((b, h, t, dv), jnp.float32))
    (_, total, acc), _ = jax.lax.scan(step, init, (jnp.arange(n_blocks), k_blocks, v_blocks))
    return acc / jnp.where(total > 0, total, 1.0)[..., None]
