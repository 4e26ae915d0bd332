"""MLA attention in Pallas on the Triton backend (NVIDIA, and AMD through ROCm).

Prefill (`_flash_kernel`), naive form: one program per (sequence, head, block of BLOCK_Q queries)
runs an fp32 online softmax over blocks of BLOCK_K keys, stopping at the last key block any of its
queries can see (causal), so fully masked blocks are never read. Every sequence is described by
(q_start, q_len, k_start, k_len, q_offset) into packed [tokens, H, D] arrays: the padded batch is a
free reshape of [B, T, H, D], the variable-length form is flash-attn's packing. Query t of a
sequence sees keys s < k_len with s <= q_offset + t.

Paged decode (`_paged_decode_kernel`), absorbed form: one program per (sequence, split) walks its
share of the sequence's pages (flash-decoding) with all heads of the sequence as the rows of one
dot, so each cache row is read once per sequence; padded to at least 16 rows for the tensor cores.
Each split writes a partial (max, sum, acc) in fp32 and `_combine_splits` (XLA, tiny) merges them.
Page sizes: any power of 2 >= 16 (K3: 64); a program takes min(page_size, DECODE_ROWS) rows per step,
so a step never crosses a page and reads one table entry. fp8 E4M3 pages are widened to q's dtype in
registers (exact: e4m3 fits in bf16); kv_scale is folded into the softmax scale and the output.

Dots of widths that are not powers of 2 (192 = 128 + 64, 576 = 512 + 64) are sums of dots over
power-of-2 column pieces, loaded separately, rather than padded in memory.

Not yet measured on a GPU: the block sizes, warps and stages are first choices (FA2-like 64 x 64
blocks, four warps), checked only by lowering to Triton IR for sm_90 and gfx942 (the tests), not by
compiling or timing; benchmarks/gpu_check_mla.py is the check.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_Q, BLOCK_K = 64, 64
DECODE_ROWS = 32  # cache rows per decode step (at most one page): a bf16 [32, 576] tile per step
MIN_DOT = 16  # the smallest dot dimension Triton's tensor-core lowering accepts
PAGES_PER_SPLIT = 16  # decode: aim for >= 16 pages (1024 tokens at page 64) of work per split
MAX_SPLITS = 32
LOG2E = math.log2(math.e)


def column_pieces(width: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) power-of-2 pieces of `width`, largest first: 192 -> (0, 128), (128, 64)."""
    pieces, offset = [], 0
    for bit in reversed(range(width.bit_length())):
        if width & (1 << bit):
            pieces.append((offset, 1 << bit))
            offset += 1 << bit
    return tuple(pieces)


def fits_dot(width: int) -> bool:
    """True when every power-of-2 piece of `width` is at least MIN_DOT wide."""
    return width > 0 and width % MIN_DOT == 0


def _as_array(x):
    """A scalar as a [1] fp32 input: it may be traced, and a kernel cannot close over a traced value."""
    return jnp.reshape(jnp.asarray(x, jnp.float32), (1,))


def _online_softmax_step(carry, logits, visible, values_dot):
    """One block of the fp32 online softmax in base 2. logits [R, K] (already times log2 e), visible
    [R, K] or None (all visible); values_dot(p) -> [R, Dv]. Rows that have seen no key keep
    max = -inf and sum = 0."""
    peak, total, acc = carry
    if visible is not None:
        logits = jnp.where(visible, logits, -jnp.inf)
    new_peak = jnp.maximum(peak, jnp.max(logits, axis=1))
    safe_peak = jnp.where(new_peak == -jnp.inf, 0.0, new_peak)  # exp2(-inf - 0) = 0, never NaN
    p = jnp.exp2(logits - safe_peak[:, None])
    rescale = jnp.exp2(peak - safe_peak)
    return new_peak, total * rescale + jnp.sum(p, axis=1), acc * rescale[:, None] + values_dot(p)


def _init_carry(rows: int, width: int):
    return (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, width), jnp.float32))


# ---------------------------------------------------------------------------------------------- prefill

def _flash_kernel(scale_ref, q_start_ref, q_len_ref, k_start_ref, k_len_ref, q_offset_ref,
                  q_ref, k_ref, v_ref, o_ref):
    seq, head, q_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_len, k_len, q_offset = q_len_ref[seq], k_len_ref[seq], q_offset_ref[seq]
    t = q_block * BLOCK_Q + jnp.arange(BLOCK_Q)
    q_rows = pl.ds(q_start_ref[seq] + q_block * BLOCK_Q, BLOCK_Q)
    q_valid = t < q_len
    qk_scale = scale_ref[0] * LOG2E
    queries = [plgpu.load(q_ref.at[q_rows, head, pl.ds(off, w)], mask=q_valid[:, None], other=0)
               for off, w in column_pieces(q_ref.shape[-1])]
    # Keys past the block's last query (causal) or past k_len are never visible: stop before them.
    # Blocks before the first query's diagonal that end within k_len are wholly visible: no masks.
    last_query = jnp.minimum(q_len, (q_block + 1) * BLOCK_Q) - 1
    k_end = jnp.minimum(k_len, q_offset + last_query + 1)
    num_k_blocks = jnp.where(q_block * BLOCK_Q < q_len, pl.cdiv(jnp.maximum(k_end, 0), BLOCK_K), 0)
    num_full = jnp.minimum(jnp.minimum(q_offset + q_block * BLOCK_Q + 1, k_len) // BLOCK_K, num_k_blocks)
    num_full = jnp.maximum(num_full, 0)
    k_start = k_start_ref[seq]

    def key_block(j, carry, masked):
        s = j * BLOCK_K + jnp.arange(BLOCK_K)
        k_rows = pl.ds(k_start + j * BLOCK_K, BLOCK_K)
        k_valid = s < k_len
        load = functools.partial(plgpu.load, mask=k_valid[:, None], other=0) if masked else plgpu.load
        logits = sum(jax.lax.dot_general(query, load(k_ref.at[k_rows, head, pl.ds(off, w)]),
                                         (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                     for query, (off, w) in zip(queries, column_pieces(k_ref.shape[-1])))
        values = load(v_ref.at[k_rows, head, :])
        visible = k_valid[None, :] & (s[None, :] <= q_offset + t[:, None]) if masked else None
        return _online_softmax_step(carry, logits * qk_scale, visible,
                                    lambda p: jnp.dot(p.astype(values.dtype), values,
                                                      preferred_element_type=jnp.float32))

    carry = jax.lax.fori_loop(0, num_full, functools.partial(key_block, masked=False),
                              _init_carry(BLOCK_Q, v_ref.shape[-1]))
    _, total, acc = jax.lax.fori_loop(num_full, num_k_blocks, functools.partial(key_block, masked=True), carry)
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]  # a query that sees no key gets zeros
    plgpu.store(o_ref.at[q_rows, head, :], out.astype(o_ref.dtype), mask=q_valid[:, None])


def _flash(q, k, v, scale, q_start, q_len, k_start, k_len, q_offset, max_q_len, interpret):
    """Packed q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv]; per-sequence int32 [N] descriptors."""
    grid = (q_start.shape[0], q.shape[1], pl.cdiv(max_q_len, BLOCK_Q))
    return pl.pallas_call(
        _flash_kernel,
        grid=grid,
        out_shape=jax.ShapeDtypeStruct((q.shape[0], q.shape[1], v.shape[-1]), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="mla_flash_prefill",
    )(_as_array(scale), *(x.astype(jnp.int32) for x in (q_start, q_len, k_start, k_len, q_offset)), q, k, v)


def causal_attention(q, k, v, *, q_offset, kv_length, scale, interpret=False):
    """Padded batch: q [B, T, H, Dqk], k [B, S, H, Dqk], v [B, S, H, Dv] (contract of reference.py)."""
    b, t, h, _ = q.shape
    s = k.shape[1]
    rows = jnp.arange(b, dtype=jnp.int32)
    out = _flash(q.reshape(b * t, h, -1), k.reshape(b * s, h, -1), v.reshape(b * s, h, -1), scale,
                 q_start=rows * t, q_len=jnp.full((b,), t, jnp.int32), k_start=rows * s,
                 k_len=jnp.clip(kv_length, 0, s), q_offset=q_offset, max_q_len=t, interpret=interpret)
    return out.reshape(b, t, h, -1)


def varlen_causal_attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, scale, max_seqlen_q=None, interpret=False):
    """Packed q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] (contract of reference.py)."""
    q_len = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    k_len = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    out = _flash(q, k, v, scale, q_start=cu_seqlens_q[:-1], q_len=q_len, k_start=cu_seqlens_k[:-1], k_len=k_len,
                 q_offset=k_len - q_len, max_q_len=max_seqlen_q or q.shape[0], interpret=interpret)
    owned = jnp.arange(q.shape[0]) < cu_seqlens_q[-1]  # no program writes the rows past the last sequence
    return jnp.where(owned[:, None, None], out, 0)


# ----------------------------------------------------------------------------------------------- decode

def _paged_decode_kernel(scale_ref, kv_length_ref, page_table_ref, q_ref, pages_ref, acc_ref, peak_ref, total_ref,
                         *, pages_per_split):
    seq, split = pl.program_id(0), pl.program_id(1)
    page_size, width = pages_ref.shape[1], pages_ref.shape[2]
    rows = min(page_size, DECODE_ROWS)
    length = kv_length_ref[seq]
    qk_scale = scale_ref[0] * LOG2E  # the fp8 pages' kv_scale is folded in by the caller
    queries = [q_ref[seq, :, pl.ds(off, w)] for off, w in column_pieces(width)]
    compute_dtype = queries[0].dtype
    # This split's tokens, [first, end), in steps of `rows` that never cross a page.
    first = split * pages_per_split * page_size
    end = jnp.minimum(length, first + pages_per_split * page_size)
    num_steps = pl.cdiv(jnp.maximum(end - first, 0), rows)

    def step(i, carry):
        token = first + i * rows
        page = page_table_ref[seq, token // page_size]
        valid = token + jnp.arange(rows) < length
        # Rows past the length may be unwritten (NaN bit patterns in fp8): not read, then zeroed (a
        # masked load's `other` cannot be an fp8 constant in Triton lowering).
        tiles = [jnp.where(valid[:, None], plgpu.load(
                    pages_ref.at[page, pl.ds(token % page_size, rows), pl.ds(off, w)], mask=valid[:, None]
                 ).astype(compute_dtype), 0) for off, w in column_pieces(width)]
        logits = sum(jax.lax.dot_general(query, tile, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                     for query, tile in zip(queries, tiles))
        return _online_softmax_step(carry, logits * qk_scale, valid[None, :],
                                    lambda p: jnp.dot(p.astype(compute_dtype), tiles[0],  # the latent
                                                      preferred_element_type=jnp.float32))

    peak, total, acc = jax.lax.fori_loop(0, num_steps, step, _init_carry(*acc_ref.shape[2:]))
    acc_ref[seq, split] = acc
    peak_ref[seq, split] = peak
    total_ref[seq, split] = total


def num_splits_for(max_pages: int) -> int:
    """Splits of the context per sequence, from the page table's width (static)."""
    return max(1, min(MAX_SPLITS, max_pages // PAGES_PER_SPLIT))


def paged_decode_attention(q_latent, pages, page_table, kv_length, *, scale, value_width, kv_scale=None,
                           interpret=False):
    """q_latent [B, H, C], pages [P, page_size, C] (contract of reference.py). Needs page_size a power of
    2 >= 16, C a multiple of 16 and value_width its largest power-of-2 piece (576: 512)."""
    b, h, _ = q_latent.shape
    max_pages = page_table.shape[1]
    num_splits = num_splits_for(max_pages)
    pages_per_split = pl.cdiv(max_pages, num_splits)
    dequant = jnp.float32(1.0) if kv_scale is None else jnp.asarray(kv_scale, jnp.float32)
    lengths = jnp.minimum(kv_length, max_pages * pages.shape[1]).astype(jnp.int32)  # never past the table
    head_rows = max(MIN_DOT, 1 << (h - 1).bit_length())  # the heads are the rows of a dot: >= 16
    q_latent_rows = jnp.pad(q_latent, ((0, 0), (0, head_rows - h), (0, 0)))
    kernel = functools.partial(_paged_decode_kernel, pages_per_split=pages_per_split)
    partial_shape = (b, num_splits, head_rows)
    acc, peak, total = pl.pallas_call(
        kernel,
        grid=(b, num_splits),
        out_shape=(jax.ShapeDtypeStruct((*partial_shape, value_width), jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="mla_paged_decode",
    )(_as_array(scale * dequant), lengths, page_table.astype(jnp.int32), q_latent_rows, pages)
    out = _combine_splits(acc[:, :, :h], peak[:, :, :h], total[:, :, :h])
    return (out * dequant).astype(q_latent.dtype)


def _combine_splits(acc, peak, total):
    """Merges per-split (acc [B, S, H, D], base-2 max and sum [B, S, H]) into [B, H, D] fp32."""
    best = jnp.max(peak, axis=1, keepdims=True)
    weight = jnp.exp2(peak - jnp.where(best == -jnp.inf, 0.0, best))  # empty splits weigh 0
    total = jnp.sum(weight * total, axis=1)
    out = jnp.sum(weight[..., None] * acc, axis=1)
    return out / jnp.where(total > 0, total, 1.0)[..., None]
