"""MLA attention in Pallas on the Triton backend (NVIDIA, and AMD through ROCm).

Prefill (`_flash_kernel`), naive form: one program per (sequence, head, block of block_q queries)
runs an fp32 online softmax over blocks of block_k keys, stopping at the last key block any of its
queries can see (causal), so fully masked blocks are never read. Every sequence is described by
(q_start, q_len, k_start, k_len, q_offset) into packed [tokens, H, D] arrays: the padded batch is a
free reshape of [B, T, H, D], the variable-length form is flash-attn's packing. Query t of a
sequence sees keys s < k_len with s <= q_offset + t.

Paged decode (`_paged_decode_kernel`), absorbed form: one program per (sequence, split) walks its
share of the sequence's pages (flash-decoding) with all heads of the sequence as the rows of one
dot, so each cache row is read once per sequence; padded to at least 16 rows for the tensor cores.
Each split writes a partial (max, sum, acc) in fp32 and `_combine_splits` (XLA, tiny) merges them.
Page sizes: any power of 2 >= 16 (K3: 64); a program takes min(page_size, block_rows) rows per step,
so a step never crosses a page and reads one table entry. fp8 E4M3 pages are widened to q's dtype in
registers (exact: e4m3 fits in bf16); kv_scale is folded into the softmax scale and the output.

Dots of widths that are not powers of 2 (192 = 128 + 64, 576 = 512 + 64) are sums of dots over
power-of-2 column pieces, loaded separately, rather than padded in memory.

Tuning knobs (block sizes, warps, stages) are keyword arguments of the public functions. Not yet
measured on a GPU: their defaults are first choices (FA2-like 64 x 64 blocks, four warps), checked
only by lowering to Triton IR for sm_90 and gfx942 (the tests), not by compiling or timing;
benchmarks/gpu_check_mla.py is the check. The kernels index whole arrays (no BlockSpecs), so each
ref below is annotated with the array it holds and each loaded tile with its shape.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_DOT = 16  # the smallest dot dimension Triton's tensor-core lowering accepts
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

def _flash_kernel(
    scale_ref,     # [1] fp32
    q_start_ref,   # [N] int32: per sequence, its first query row
    q_len_ref,     # [N] int32
    k_start_ref,   # [N] int32: per sequence, its first key row
    k_len_ref,     # [N] int32
    q_offset_ref,  # [N] int32: the position of a sequence's first query among its keys
    q_ref,         # [Tq, H, Dqk], read as [block_q, w] tiles per power-of-2 piece w of Dqk
    k_ref,         # [Tk, H, Dqk], read as [block_k, w] tiles
    v_ref,         # [Tk, H, Dv], read as [block_k, Dv] tiles
    o_ref,         # [Tq, H, Dv], written as a [block_q, Dv] tile
    *,
    block_q: int,
    block_k: int,
):
    seq, head, q_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_len, k_len, q_offset = q_len_ref[seq], k_len_ref[seq], q_offset_ref[seq]
    t = q_block * block_q + jnp.arange(block_q)
    q_rows = pl.ds(q_start_ref[seq] + q_block * block_q, block_q)
    q_valid = t < q_len
    qk_scale = scale_ref[0] * LOG2E
    queries = [plgpu.load(q_ref.at[q_rows, head, pl.ds(off, w)], mask=q_valid[:, None], other=0)
               for off, w in column_pieces(q_ref.shape[-1])]
    # Keys past the block's last query (causal) or past k_len are never visible: stop before them.
    # Blocks before the first query's diagonal that end within k_len are wholly visible: no masks.
    last_query = jnp.minimum(q_len, (q_block + 1) * block_q) - 1
    k_end = jnp.minimum(k_len, q_offset + last_query + 1)
    num_k_blocks = jnp.where(q_block * block_q < q_len, pl.cdiv(jnp.maximum(k_end, 0), block_k), 0)
    num_full = jnp.minimum(jnp.minimum(q_offset + q_block * block_q + 1, k_len) // block_k, num_k_blocks)
    num_full = jnp.maximum(num_full, 0)
    k_start = k_start_ref[seq]

    def key_block(j, carry, masked):
        s = j * block_k + jnp.arange(block_k)
        k_rows = pl.ds(k_start + j * block_k, block_k)
        k_valid = s < k_len
        load = functools.partial(plgpu.load, mask=k_valid[:, None], other=0) if masked else plgpu.load
        logits = sum(jax.lax.dot_general(query, load(k_ref.at[k_rows, head, pl.ds(off, w)]),
                                         (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                     for query, (off, w) in zip(queries, column_pieces(k_ref.shape[-1])))  # [block_q, block_k]
        values = load(v_ref.at[k_rows, head, :])  # [block_k, Dv]
        visible = k_valid[None, :] & (s[None, :] <= q_offset + t[:, None]) if masked else None
        return _online_softmax_step(carry, logits * qk_scale, visible,
                                    lambda p: jnp.dot(p.astype(values.dtype), values,
                                                      preferred_element_type=jnp.float32))

    carry = jax.lax.fori_loop(0, num_full, functools.partial(key_block, masked=False),
                              _init_carry(block_q, v_ref.shape[-1]))
    _, total, acc = jax.lax.fori_loop(num_full, num_k_blocks, functools.partial(key_block, masked=True), carry)
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]  # a query that sees no key gets zeros
    plgpu.store(o_ref.at[q_rows, head, :], out.astype(o_ref.dtype), mask=q_valid[:, None])


def _flash(q, k, v, scale, q_start, q_len, k_start, k_len, q_offset, max_q_len, *, block_q, block_k, num_warps,
           num_stages, interpret):
    """Packed q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv]; per-sequence int32 [N] descriptors."""
    grid = (q_start.shape[0], q.shape[1], pl.cdiv(max_q_len, block_q))
    return pl.pallas_call(
        functools.partial(_flash_kernel, block_q=block_q, block_k=block_k),
        grid=grid,
        out_shape=jax.ShapeDtypeStruct((q.shape[0], q.shape[1], v.shape[-1]), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_flash_prefill",
    )(_as_array(scale), *(x.astype(jnp.int32) for x in (q_start, q_len, k_start, k_len, q_offset)), q, k, v)


def causal_attention(
    q,          # [B, T, H, Dqk]
    k,          # [B, S, H, Dqk]
    v,          # [B, S, H, Dv]
    *,
    q_offset,   # [B]
    kv_length,  # [B]
    scale,
    block_q: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
):
    """Padded batch (contract of reference.py); block_q, block_k powers of 2 >= 16."""
    b, t, h, _ = q.shape
    s = k.shape[1]
    rows = jnp.arange(b, dtype=jnp.int32)
    out = _flash(q.reshape(b * t, h, -1), k.reshape(b * s, h, -1), v.reshape(b * s, h, -1), scale,
                 q_start=rows * t, q_len=jnp.full((b,), t, jnp.int32), k_start=rows * s,
                 k_len=jnp.clip(kv_length, 0, s), q_offset=q_offset, max_q_len=t, block_q=block_q, block_k=block_k,
                 num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return out.reshape(b, t, h, -1)


def varlen_causal_attention(
    q,             # [Tq, H, Dqk]
    k,             # [Tk, H, Dqk]
    v,             # [Tk, H, Dv]
    *,
    cu_seqlens_q,  # [N + 1]
    cu_seqlens_k,  # [N + 1]
    scale,
    max_seqlen_q: int | None = None,
    block_q: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
):
    """Packed sequences (contract of reference.py); block_q, block_k powers of 2 >= 16."""
    q_len = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    k_len = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    out = _flash(q, k, v, scale, q_start=cu_seqlens_q[:-1], q_len=q_len, k_start=cu_seqlens_k[:-1], k_len=k_len,
                 q_offset=k_len - q_len, max_q_len=max_seqlen_q or q.shape[0], block_q=block_q, block_k=block_k,
                 num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    owned = jnp.arange(q.shape[0]) < cu_seqlens_q[-1]  # no program writes the rows past the last sequence
    return jnp.where(owned[:, None, None], out, 0)


# ----------------------------------------------------------------------------------------------- decode

def _paged_decode_kernel(
    scale_ref,       # [1] fp32, kv_scale folded in
    kv_length_ref,   # [B] int32
    page_table_ref,  # [B, max_pages] int32
    q_ref,           # [B, Hp, C], Hp >= 16 padded heads; read as [Hp, w] per power-of-2 piece w of C
    pages_ref,       # [P, page_size, C], read as [rows, w] tiles of one page
    acc_ref,         # [B, splits, Hp, value_width] fp32, written as one [Hp, value_width] tile
    peak_ref,        # [B, splits, Hp] fp32: the base-2 softmax max of the split
    total_ref,       # [B, splits, Hp] fp32: the softmax sum of the split
    *,
    pages_per_split: int,
    block_rows: int,
):
    seq, split = pl.program_id(0), pl.program_id(1)
    page_size, width = pages_ref.shape[1], pages_ref.shape[2]
    rows = min(page_size, block_rows)
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
                     for query, tile in zip(queries, tiles))  # [Hp, rows]
        return _online_softmax_step(carry, logits * qk_scale, valid[None, :],
                                    lambda p: jnp.dot(p.astype(compute_dtype), tiles[0],  # the latent
                                                      preferred_element_type=jnp.float32))

    peak, total, acc = jax.lax.fori_loop(0, num_steps, step, _init_carry(*acc_ref.shape[2:]))
    acc_ref[seq, split] = acc
    peak_ref[seq, split] = peak
    total_ref[seq, split] = total


def paged_decode_attention(
    q_latent,    # [B, H, C]
    pages,       # [P, page_size, C]
    page_table,  # [B, max_pages]
    kv_length,   # [B]
    *,
    scale,
    value_width: int,
    kv_scale=None,
    block_rows: int = 32,
    min_pages_per_split: int = 16,
    max_splits: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
):
    """Contract of reference.py. Needs page_size a power of 2 >= 16, C a multiple of 16 and value_width
    its largest power-of-2 piece (576: 512).

    block_rows: cache rows per step (a power of 2 >= 16; at most one page is taken): 32 rows of 576
    bf16 is a 36 KiB tile. The context splits into at most max_splits parts of at least
    min_pages_per_split pages each (16 pages: 1024 tokens at page 64), one program each."""
    b, h, _ = q_latent.shape
    max_pages = page_table.shape[1]
    num_splits = max(1, min(max_splits, max_pages // min_pages_per_split))
    pages_per_split = pl.cdiv(max_pages, num_splits)
    dequant = jnp.float32(1.0) if kv_scale is None else jnp.asarray(kv_scale, jnp.float32)
    lengths = jnp.minimum(kv_length, max_pages * pages.shape[1]).astype(jnp.int32)  # never past the table
    head_rows = max(MIN_DOT, 1 << (h - 1).bit_length())  # the heads are the rows of a dot: >= 16
    q_latent_rows = jnp.pad(q_latent, ((0, 0), (0, head_rows - h), (0, 0)))
    kernel = functools.partial(_paged_decode_kernel, pages_per_split=pages_per_split, block_rows=block_rows)
    partial_shape = (b, num_splits, head_rows)
    acc, peak, total = pl.pallas_call(
        kernel,
        grid=(b, num_splits),
        out_shape=(jax.ShapeDtypeStruct((*partial_shape, value_width), jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_paged_decode",
    )(_as_array(scale * dequant), lengths, page_table.astype(jnp.int32), q_latent_rows, pages)
    out = _combine_splits(acc[:, :, :h], peak[:, :, :h], total[:, :, :h])
    return (out * dequant).astype(q_latent.dtype)


def _combine_splits(acc_BSHD, peak_BSH, total_BSH):
    """Merges per-split partials (S splits; base-2 max and sum) into [B, H, D] fp32."""
    best_B1H = jnp.max(peak_BSH, axis=1, keepdims=True)
    weight_BSH = jnp.exp2(peak_BSH - jnp.where(best_B1H == -jnp.inf, 0.0, best_B1H))  # empty splits weigh 0
    total_BH = jnp.sum(weight_BSH * total_BSH, axis=1)
    out_BHD = jnp.sum(weight_BSH[..., None] * acc_BSHD, axis=1)
    return out_BHD / jnp.where(total_BH > 0, total_BH, 1.0)[..., None]
