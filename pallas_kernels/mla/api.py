"""MLA attention ops. `impl="auto"` picks XLA everywhere until the Pallas kernels land ([kernels])."""

from __future__ import annotations

from pallas_kernels.mla import reference, xla

_IMPLS = {"xla": xla, "reference": reference}


def _module(impl: str):
    if impl == "auto":
        return xla
    if impl == "pallas":
        raise ValueError("impl='pallas': the Pallas MLA kernels are not available yet; use 'auto' or 'xla'")
    if impl not in _IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose 'auto', 'xla' or 'reference'")
    return _IMPLS[impl]


def causal_attention(q, k, v, *, q_offset, kv_length, scale, impl: str = "auto"):
    """Naive-form (prefill) MLA attention.

    q [B, T, H, Dqk] are the queries of positions q_offset[b] + t; k [B, S, H, Dqk] and
    v [B, S, H, Dv] hold positions 0..S-1 of each sequence, of which the first kv_length[b] are valid.
    Key s is visible to query t iff s <= q_offset[b] + t and s < kv_length[b]. Softmax in fp32.
    Returns [B, T, H, Dv] in q's dtype; a query that sees no key gets zeros.
    """
    if q.ndim != 4 or k.shape[:3] != (q.shape[0], k.shape[1], q.shape[2]) or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} must be [B, T, H, D] and [B, S, H, D]")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {v.shape} must match k {k.shape} in [B, S, H]")
    return _module(impl).causal_attention(q, k, v, q_offset=q_offset, kv_length=kv_length, scale=scale)


def latent_decode_attention(q_latent, cache, *, kv_length, scale, value_width: int, impl: str = "auto"):
    """Absorbed-form (decode) MLA attention over a contiguous latent cache.

    q_latent [B, H, C]: per head, the query mapped into latent space (W_UK^T q_nope) joined with the
    shared-key part q_rope; cache [B, S, C] rows are [normalised latent | shared key]; the first
    kv_length[b] rows are valid. Returns the attention-weighted latent [B, H, value_width].
    """
    if q_latent.ndim != 3 or cache.ndim != 3 or q_latent.shape[2] != cache.shape[2]:
        raise ValueError(f"q_latent {q_latent.shape} and cache {cache.shape} must be [B, H, C] and [B, S, C]")
    return _module(impl).latent_decode_attention(q_latent, cache, kv_length=kv_length, scale=scale,
                                                 value_width=value_width)
