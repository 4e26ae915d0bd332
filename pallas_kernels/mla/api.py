"""MLA attention ops (ARCHITECTURE.md, "Kernels"): naive-form prefill, padded, packed or over a page pool, and
absorbed-form decode over a contiguous cache or a page pool, of one token or a few (extend).

impl: "auto" (the Pallas-Triton kernels on GPU when the shapes suit them, the XLA path otherwise),
"xla", "reference" or "pallas" (pallas_triton.py; off a GPU it runs in interpret mode, slow, for
tests). Pallas needs: prefill, Dqk a multiple of 16 (split into power-of-2 pieces, 192 = 128 + 64)
and Dv a power of 2 >= 16; decode, C a multiple of 16 whose largest power-of-2 piece is value_width
(576 = 512 + 64) and page_size a power of 2 >= 16 (K3: 64). pallas_kernels.dispatch says how "auto"
chooses and how a Pallas call runs per shard under a mesh.

`**tuning`: keyword arguments of the Pallas kernel that runs (block sizes, warps, stages: see the
functions of the same name in pallas_triton.py, which hold the defaults); the other implementations
take none and ignore them, so a caller may pass them whatever impl "auto" picks.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.mla import pallas_triton, reference, xla

_FP8 = (jnp.float8_e4m3fn,)


def causal_attention(q, k, v, *, q_offset, kv_length, scale, impl: str = "auto", **tuning):
    """Naive-form (prefill) MLA attention.

    q [B, T, H, Dqk] are the queries of positions q_offset[b] + t; k [B, S, H, Dqk] and
    v [B, S, H, Dv] hold positions 0..S-1 of each sequence, of which the first kv_length[b] are valid
    (a cached prefix expanded from pages, then the new tokens: how chunked prefill sees its cache).
    Key s is visible to query t iff s <= q_offset[b] + t and s < kv_length[b]. Softmax in fp32.
    Returns [B, T, H, Dv] in q's dtype; a query that sees no key gets zeros.
    """
    if q.ndim != 4 or k.shape[:3] != (q.shape[0], k.shape[1], q.shape[2]) or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} must be [B, T, H, D] and [B, S, H, D]")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {v.shape} must match k {k.shape} in [B, S, H]")
    impl = dispatch.resolve(impl, _prefill_fits(q, v), f"q {q.shape}, v {v.shape}")
    if impl == "pallas":
        def kernel(q, k, v, q_offset, kv_length, scale):
            return pallas_triton.causal_attention(q, k, v, q_offset=q_offset, kv_length=kv_length, scale=scale,
                                                  interpret=not dispatch.on_gpu(), **tuning)
        heads = ("rows", None, "heads", None)
        return dispatch.per_shard(kernel, (q, k, v, q_offset, kv_length, scale),
                                  (heads, heads, heads, ("rows",), ("rows",), None), heads)
    return _module(impl).causal_attention(q, k, v, q_offset=q_offset, kv_length=kv_length, scale=scale)


def varlen_causal_attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, scale, max_seqlen_q: int | None = None,
                            impl: str = "auto", **tuning):
    """Packed variable-length prefill, flash-attn's varlen convention.

    q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv]; cu_seqlens_q, cu_seqlens_k int32 [N + 1] offsets
    (from 0). Sequence n's queries are rows cu_seqlens_q[n]:cu_seqlens_q[n + 1] and its keys rows
    cu_seqlens_k[n]:cu_seqlens_k[n + 1]; its queries are the LAST q_len of its k_len positions
    (causal within the sequence). Rows past cu_seqlens_q[N] get zeros. max_seqlen_q (static, optional)
    bounds the longest query run and sizes the Pallas grid; without it the grid covers Tq per sequence.
    Returns [Tq, H, Dv] in q's dtype.
    """
    if q.ndim != 3 or k.ndim != 3 or k.shape[1:] != q.shape[1:]:
        raise ValueError(f"q {q.shape} and k {k.shape} must be [Tq, H, D] and [Tk, H, D]")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v {v.shape} must match k {k.shape} in [Tk, H]")
    if cu_seqlens_q.ndim != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q {cu_seqlens_q.shape} and cu_seqlens_k {cu_seqlens_k.shape} must both be [N + 1]")
    args = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "scale": scale}
    impl = dispatch.resolve(impl, _prefill_fits(q, v), f"q {q.shape}, v {v.shape}")
    if impl == "pallas":
        def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
            return pallas_triton.varlen_causal_attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                                         scale=scale, max_seqlen_q=max_seqlen_q,
                                                         interpret=not dispatch.on_gpu(), **tuning)
        heads = (None, "heads", None)  # packed rows: split over heads only
        return dispatch.per_shard(kernel, (q, k, v, cu_seqlens_q, cu_seqlens_k, scale),
                                  (heads, heads, heads, None, None, None), heads)
    return _module(impl).varlen_causal_attention(q, k, v, **args)


def paged_decode_attention(q_latent, pages, page_table, kv_length, *, scale, value_width: int = 512,
                           kv_scale=None, impl: str = "auto", **tuning):
    """Absorbed-form (decode) MLA attention over a page pool.

    q_latent [B, H, C]: per head, the query mapped into latent space joined with the shared-key
    part. pages [P, page_size, C], bf16 or float8_e4m3fn: rows [normalised latent | shared key],
    shared by all heads. Sequence b's row s is pages[page_table[b, s // page_size], s % page_size]
    for s < kv_length[b]; table entries past that are ignored (any id), and a length of 0 gives
    zeros. kv_scale: fp32 scalar, true row = stored * kv_scale (required for fp8 pages).
    Returns the attention-weighted latent [B, H, value_width] in q_latent's dtype.
    """
    _check_paged(q_latent, pages, page_table, kv_length, value_width, kv_scale)
    impl = dispatch.resolve(impl, _decode_fits(pages.shape[1], pages.shape[2], value_width),
                            f"pages {pages.shape}, value_width {value_width}")
    if impl == "pallas":
        return _paged_decode_per_shard(q_latent, pages, page_table, kv_length, scale, value_width, kv_scale, tuning)
    return _module(impl).paged_decode_attention(q_latent, pages, page_table, kv_length, scale=scale,
                                                value_width=value_width, kv_scale=kv_scale)


def paged_extend_attention(q_latent, pages, page_table, *, q_offset, kv_length, scale, value_width: int = 512,
                           kv_scale=None, impl: str = "auto", **tuning):
    """Absorbed-form MLA attention of T new tokens per sequence over a page pool (a speculative
    verify window, a short prefill chunk): q_latent [B, T, H, C] are the queries of positions
    q_offset[b] + t, in latent space as for paged_decode_attention; query t sees rows
    s <= q_offset[b] + t with s < kv_length[b] (the new tokens' rows already written).
    Returns [B, T, H, value_width] in q_latent's dtype.

    The Pallas path runs the paged decode kernel with each query row as its own sequence (the row's
    page table repeated, its length cut at the query's position), so it reads each page T times.
    """
    if q_latent.ndim != 4:
        raise ValueError(f"q_latent {q_latent.shape} must be [B, T, H, C]")
    b, t, h, c = q_latent.shape
    if q_offset.shape != (b,):
        raise ValueError(f"q_offset {q_offset.shape} must be [B] with B = {b}")
    impl = dispatch.resolve(impl, _decode_fits(pages.shape[1], pages.shape[2], value_width),
                            f"pages {pages.shape}, value_width {value_width}")
    if impl == "pallas":
        lengths = jnp.clip(q_offset[:, None] + jnp.arange(t)[None, :] + 1, 0, kv_length[:, None]).reshape(-1)
        table = page_table if t == 1 else jnp.repeat(page_table, t, axis=0)
        out = paged_decode_attention(q_latent.reshape(b * t, h, c), pages, table,
                                     lengths, scale=scale, value_width=value_width, kv_scale=kv_scale, impl="pallas",
                                     **tuning)
        return out.reshape(b, t, h, value_width)
    _check_paged(q_latent[:, 0], pages, page_table, kv_length, value_width, kv_scale)
    return _module(impl).paged_extend_attention(q_latent, pages, page_table, q_offset=q_offset, kv_length=kv_length,
                                                scale=scale, value_width=value_width, kv_scale=kv_scale)


def paged_prefill_attention(q, pages, page_table, w_uk, w_uv, *, q_offset, kv_length, scale, kv_scale=None,
                            impl: str = "auto"):
    """Naive-form MLA attention of a prefill chunk over a page pool: q [B, T, H, nope + rope] are the
    queries of positions q_offset[b] + t; the pool's rows [normalised latent | shared key] (paged as
    in paged_decode_attention, the chunk's own rows already written) are expanded per head by
    w_uk [H, nope, C_lat] into keys [k_nope | shared key] and by w_uv [H, v, C_lat] into values.
    Query t sees rows s <= q_offset[b] + t with s < kv_length[b]. Returns [B, T, H, v] in q's dtype.

    XLA only ("pallas" is refused): the rows are expanded a block of pages at a time as the online
    softmax reaches them, so the work follows each context's length, never the page table's width.
    """
    if q.ndim != 4 or w_uk.ndim != 3 or w_uv.ndim != 3 or w_uk.shape[0] != q.shape[2] \
            or w_uv.shape[::2] != w_uk.shape[::2]:
        raise ValueError(f"q {q.shape}, w_uk {w_uk.shape} and w_uv {w_uv.shape} must be [B, T, H, nope + rope], "
                         f"[H, nope, C_lat] and [H, v, C_lat]")
    if pages.ndim != 3 or pages.shape[2] - w_uk.shape[2] != q.shape[3] - w_uk.shape[1]:
        raise ValueError(f"pages {pages.shape} must be [P, page_size, C_lat + rope] for q {q.shape} "
                         f"and w_uk {w_uk.shape}")
    _check_table(q.shape[0], page_table, kv_length, pages, kv_scale)
    if q_offset.shape != (q.shape[0],):
        raise ValueError(f"q_offset {q_offset.shape} must be [B] with B = {q.shape[0]}")
    impl = dispatch.resolve(impl, False, "no Pallas kernel for the paged prefill")
    return _module(impl).paged_prefill_attention(q, pages, page_table, w_uk, w_uv, q_offset=q_offset,
                                                 kv_length=kv_length, scale=scale, kv_scale=kv_scale)


def latent_decode_attention(q_latent, cache, *, kv_length, scale, value_width: int, impl: str = "auto", **tuning):
    """Absorbed-form (decode) MLA attention over a contiguous latent cache.

    q_latent [B, H, C]: per head, the query mapped into latent space (W_UK^T q_nope) joined with the
    shared-key part q_rope; cache [B, S, C] rows are [normalised latent | shared key]; the first
    kv_length[b] rows are valid. Returns the attention-weighted latent [B, H, value_width].
    """
    if q_latent.ndim != 3 or cache.ndim != 3 or q_latent.shape[2] != cache.shape[2]:
        raise ValueError(f"q_latent {q_latent.shape} and cache {cache.shape} must be [B, H, C] and [B, S, C]")
    b, s, c = cache.shape
    # The Pallas path views each row of the cache as consecutive pages: of up to 64 rows when S is a
    # multiple of 16 (a free reshape), else the cache is padded to a multiple of 64 (a copy).
    page = next((p for p in (64, 32, 16) if s % p == 0), 64)
    impl = dispatch.resolve(impl, _decode_fits(page, c, value_width), f"cache {cache.shape}, value_width {value_width}")
    if impl == "pallas":
        cache = jnp.pad(cache, ((0, 0), (0, -s % page), (0, 0)))
        pages_per_row = cache.shape[1] // page
        table = jnp.arange(b * pages_per_row, dtype=jnp.int32).reshape(b, pages_per_row)
        return _paged_decode_per_shard(q_latent, cache.reshape(-1, page, c), table, kv_length, scale, value_width,
                                       None, tuning)
    return _module(impl).latent_decode_attention(q_latent, cache, kv_length=kv_length, scale=scale,
                                                 value_width=value_width)


def _check_paged(q_latent, pages, page_table, kv_length, value_width, kv_scale):
    """The absorbed form's operands: q_latent [B, H, C] against pages [P, page_size, C]."""
    if q_latent.ndim != 3 or pages.ndim != 3 or pages.shape[2] != q_latent.shape[2]:
        raise ValueError(f"q_latent {q_latent.shape} and pages {pages.shape} must be [B, H, C] and [P, page_size, C]")
    if not 0 < value_width <= pages.shape[2]:
        raise ValueError(f"value_width {value_width} must be in (0, {pages.shape[2]}]")
    _check_table(q_latent.shape[0], page_table, kv_length, pages, kv_scale)


def _check_table(b: int, page_table, kv_length, pages, kv_scale):
    if page_table.ndim != 2 or page_table.shape[0] != b or kv_length.shape != (b,):
        raise ValueError(f"page_table {page_table.shape} and kv_length {kv_length.shape} must be [B, max_pages] "
                         f"and [B] with B = {b}")
    if pages.dtype in _FP8 and kv_scale is None:
        raise ValueError(f"pages of dtype {pages.dtype} need kv_scale (true value = stored * kv_scale)")


def _prefill_fits(q, v) -> bool:
    dv = v.shape[-1]
    return pallas_triton.fits_dot(q.shape[-1]) and dv >= pallas_triton.MIN_DOT and dv & (dv - 1) == 0


def _decode_fits(page_size: int, width: int, value_width: int) -> bool:
    pieces = pallas_triton.column_pieces(width)
    return (pallas_triton.fits_dot(width) and pieces[0][1] == value_width
            and page_size >= pallas_triton.MIN_DOT and page_size & (page_size - 1) == 0)


def _paged_decode_per_shard(q_latent, pages, page_table, kv_length, scale, value_width, kv_scale, tuning):
    """The Pallas paged decode, each device on its heads and rows. The table holds global page ids,
    so every device gets the whole pool (replicated, or gathered if the caller split it)."""
    def kernel(q_latent, pages, page_table, kv_length, scale, kv_scale):
        return pallas_triton.paged_decode_attention(q_latent, pages, page_table, kv_length, scale=scale,
                                                    value_width=value_width, kv_scale=kv_scale,
                                                    interpret=not dispatch.on_gpu(), **tuning)
    heads = ("rows", "heads", None)
    return dispatch.per_shard(kernel, (q_latent, pages, page_table, kv_length, scale, kv_scale),
                              (heads, None, ("rows", None), ("rows",), None, None), heads)


def _module(impl: str):
    return reference if impl == "reference" else xla
