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
