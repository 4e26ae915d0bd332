"""KDA in Pallas on the Triton backend (NVIDIA, and AMD through ROCm): chunked prefill and the token loop.

Both take packed sequences (B = 1, `cu_seqlens`); api.py packs a batch of equal-length rows.

Chunked form, per head and chunk of C = 64 tokens (the algebra of xla.py), in two kernels:
1. `_intra_kernel`, one program per (chunk, head), all in parallel: the in-chunk cumulative log
   decay G, the scores Akk = beta k k^T and Aqk = q k^T decayed per channel, the solve
   (I + Akk)^-1 applied to beta v and beta k exp(G), giving u and w, and the decayed q exp(G) and
   k exp(G_last - G). Written to HBM in fp32, token-major like the inputs.
2. `_state_kernel`, one program per (sequence, head, BV columns of the state): the loop over the
   sequence's chunks, holding its fp32 [K, BV] state tile:
       v' = u - w S;   o = (q exp(G)) S + Aqk v';   S <- exp(G_last) S + (k exp(G_last - G))^T v'.
Chunks come from layout.py: they never span two sequences, ragged ends are masked loads and
stores, and with snapshots a chunk ends at each snapshot position, whose state is stored then.

Decays are only ever exp of a non-positive number. A chunk is four blocks of BLOCK = 16 rows. For
rows i of block a and keys j of an earlier block b, the decay exp(G_i - G_j) splits at R_a, the
cumulative decay just before block a, into exp(G_i - R_a) (block a's own cumulative sum), the
decay over the blocks between, and exp(end of block b - G_j): each <= 1, so each factor is a
product with rows or keys, and the scores of a block pair are one tensor-core product. Pairs inside
one block take exp(G_i - G_j) directly, one key column at a time. The exponents are differences of
cumulative sums within one chunk, so they carry an absolute error of about |G| * 6e-8, |G| the
decay summed over the chunk (as in fla).

Products run on tensor cores with fp32 accuracy up to about 2^-16: each fp32 operand is split into
a bf16 value and a bf16 remainder and three bf16 products are summed in fp32 (BF16_BF16_F32_X3,
which Triton lowers for both vendors; plain TF32 would keep 10 bits). On CPU (interpret mode) the
products are exact fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import layout
from pallas_kernels.kda.reference import L2_NORM_EPS

CHUNK = 64
BLOCK = 16  # rows per block of a chunk: the smallest tile a tensor-core product takes
BLOCKS = CHUNK // BLOCK
STATE_ROWS = 16  # rows of a chunk the state loop takes at a time, to bound the registers it holds
STATE_COLUMNS = 32  # BV: the state columns one program of the state loop or the token loop holds (at most)
PRECISION = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3


def _as_array(scale):
    """The scale as a [1] fp32 input: it may be traced, and a kernel cannot close over a traced value."""
    return jnp.reshape(jnp.asarray(scale, jnp.float32), (1,))


def _dot(a, b):
    return jax.lax.dot(a, b, precision=PRECISION, preferred_element_type=jnp.float32)


def _dot_tn(a, b):
    """a^T b, contracting the leading axis of both."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=PRECISION,
                               preferred_element_type=jnp.float32)


def _l2_normalize(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_NORM_EPS)


def _load_rows(ref, rows, head, valid, columns=slice(None)):
    """fp32 [len(rows), D] from ref [T, H, D]; rows past the chunk's end read as 0."""
    return plgpu.load(ref.at[rows, head, columns], mask=valid[:, None], other=0).astype(jnp.float32)


def _store_rows(ref, rows, head, valid, value, columns=slice(None)):
    plgpu.store(ref.at[rows, head, columns], value.astype(ref.dtype), mask=valid[:, None])


def _pick_row(x, r):
    """Row r of a block [BLOCK, D] as [D] (Triton has no register indexing: a masked sum)."""
    return jnp.sum(jnp.where(jnp.arange(BLOCK)[:, None] == r, x, 0.0), axis=0)


def _diagonal_scores(q, k, head):
    """In-block (kk, qk) [BLOCK, BLOCK]: sum_c x_i[c] k_j[c] exp(head_i[c] - head_j[c]) for j <= i,
    zero above the diagonal; head is the in-block cumulative log decay (non-increasing down the rows)."""
    rows, cols = jnp.arange(BLOCK)[:, None], jnp.arange(BLOCK)[None, :]

    def key_column(j, scores):
        kk, qk = scores
        decay = jnp.exp(jnp.minimum(head - _pick_row(head, j)[None, :], 0.0))  # the exponent is <= 0 for i >= j
        key = jnp.where(rows >= j, decay * _pick_row(k, j)[None, :], 0.0)
        return (jnp.where(cols == j, jnp.sum(k * key, axis=1)[:, None], kk),
                jnp.where(cols == j, jnp.sum(q * key, axis=1)[:, None], qk))

    zeros = jnp.zeros((BLOCK, BLOCK), jnp.float32)
    return jax.lax.fori_loop(0, BLOCK, key_column, (zeros, zeros))


def _unit_lower_inverse(a):
    """(I + a)^-1 for a strictly lower [BLOCK, BLOCK], by forward substitution over its rows."""
    rows, cols = jnp.arange(BLOCK)[:, None], jnp.arange(BLOCK)

    def solve_row(r, inverse):  # row r is e_r - a[r] (I + a)^-1, whose rows < r are done
        row = (cols == r).astype(jnp.float32) - jnp.sum(_pick_row(a, r)[:, None] * inverse, axis=0)
        return jnp.where(rows == r, row[None, :], inverse)

    return jax.lax.fori_loop(0, BLOCK, solve_row, jnp.zeros((BLOCK, BLOCK), jnp.float32))


def _intra_kernel(scale_ref, start_ref, length_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                  w_ref, u_ref, qg_ref, kg_ref, aqk_ref, decay_ref, *, l2norm):
    """One chunk and head, block by block: block a needs only its own rows and, of the earlier
    blocks, their keys decayed to the block's end and their rows of u and w."""
    chunk, head = pl.program_id(0), pl.program_id(1)
    start, length, scale = start_ref[chunk], length_ref[chunk], scale_ref[0]
    spans = [pl.ds(start + a * BLOCK, BLOCK) for a in range(BLOCKS)]
    valids = [a * BLOCK + jnp.arange(BLOCK) < length for a in range(BLOCKS)]
    # The log decay of each block, summed in the same order here as for R_a below, so that
    # G_last - G_i is not pushed above 0 by a different rounding.
    block_sums = [jnp.sum(_load_rows(g_ref, span, head, valid), axis=0) for span, valid in zip(spans, valids)]
    total = functools.reduce(jnp.add, block_sums)  # G_last
    rows, cols = jnp.arange(BLOCK)[:, None], jnp.arange(BLOCK)[None, :]
    before = jnp.zeros_like(total)  # R_a: the log decay summed over the earlier blocks
    keys, ends, us, ws = [], [], [], []  # per earlier block
    for a in range(BLOCKS):
        span, valid = spans[a], valids[a]
        q, k, v, g = (_load_rows(ref, span, head, valid) for ref in (q_ref, k_ref, v_ref, g_ref))
        beta = plgpu.load(beta_ref.at[span, head], mask=valid, other=0).astype(jnp.float32)[:, None]
        if l2norm:
            q, k = _l2_normalize(q), _l2_normalize(k)
        q = q * scale
        head_sum = jnp.cumsum(g, axis=0)  # G_i - R_a <= 0
        g_cum = before + head_sum  # G_i
        row_decay = jnp.exp(head_sum)

        # Row a of the block solve of (I + Akk) [u | w] = beta [v | k exp(G)], and row a of Aqk.
        rhs_u, rhs_w = beta * v, beta * k * jnp.exp(g_cum)
        for b in range(a):  # earlier keys: exp(R_a - G_j) = exp(R_a - end of block b) * keys[b], both <= 1
            key = keys[b] * jnp.exp(jnp.minimum(before - ends[b], 0.0))[None, :]
            akk = beta * _dot(k * row_decay, key.T)
            rhs_u -= _dot(akk, us[b])
            rhs_w -= _dot(akk, ws[b])
            _store_rows(aqk_ref, span, head, valid, _dot(q * row_decay, key.T), pl.ds(b * BLOCK, BLOCK))
        kk, qk = _diagonal_scores(q, k, head_sum)
        _store_rows(aqk_ref, span, head, valid, qk, pl.ds(a * BLOCK, BLOCK))
        for b in range(a + 1, BLOCKS):
            _store_rows(aqk_ref, span, head, valid, jnp.zeros((BLOCK, BLOCK)), pl.ds(b * BLOCK, BLOCK))
        inverse = _unit_lower_inverse(beta * jnp.where(rows > cols, kk, 0.0))
        us.append(_dot(inverse, rhs_u))
        ws.append(_dot(inverse, rhs_w))
        _store_rows(u_ref, span, head, valid, us[a])
        _store_rows(w_ref, span, head, valid, ws[a])
        _store_rows(qg_ref, span, head, valid, q * jnp.exp(g_cum))
        _store_rows(kg_ref, span, head, valid, k * jnp.exp(jnp.minimum(total - g_cum, 0.0)))

        keys.append(k * jnp.exp(jnp.minimum(block_sums[a][None, :] - head_sum, 0.0)))  # decayed to the block's end
        before = before + block_sums[a]
        ends.append(before)
    decay_ref[chunk, head, :] = jnp.exp(total)


def _state_kernel(start_ref, length_ref, snapshot_ref, seq_first_ref, seq_chunks_ref, w_ref, u_ref, qg_ref,
                  kg_ref, aqk_ref, decay_ref, initial_ref, o_ref, final_ref, *snapshot_out, width):
    seq, head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    columns = pl.ds(block * width, width)

    def chunk_step(chunk, state):
        start, length = start_ref[chunk], length_ref[chunk]
        writes = []  # v' of the row blocks so far
        for a in range(CHUNK // STATE_ROWS):
            rows = pl.ds(start + a * STATE_ROWS, STATE_ROWS)
            valid = a * STATE_ROWS + jnp.arange(STATE_ROWS) < length
            w = _load_rows(w_ref, rows, head, valid)
            writes.append(_load_rows(u_ref, rows, head, valid, columns) - _dot(w, state))
            o = _dot(_load_rows(qg_ref, rows, head, valid), state)
            for b in range(a + 1):  # Aqk is block lower triangular
                aqk = _load_rows(aqk_ref, rows, head, valid, pl.ds(b * STATE_ROWS, STATE_ROWS))
                o += _dot(aqk, writes[b])
            _store_rows(o_ref, rows, head, valid, o, columns)
        state = decay_ref[chunk, head, :][:, None] * state
        for a in range(CHUNK // STATE_ROWS):
            rows = pl.ds(start + a * STATE_ROWS, STATE_ROWS)
            valid = a * STATE_ROWS + jnp.arange(STATE_ROWS) < length
            state += _dot_tn(_load_rows(kg_ref, rows, head, valid), writes[a])
        if snapshot_out:
            row = snapshot_ref[chunk]
            plgpu.store(snapshot_out[0].at[jnp.maximum(row, 0), head, :, columns], state,
                        mask=jnp.full(state.shape, row >= 0))
        return state

    first = seq_first_ref[seq]
    state = initial_ref[seq, head, :, columns]
    final_ref[seq, head, :, columns] = jax.lax.fori_loop(first, first + seq_chunks_ref[seq], chunk_step, state)


def chunk_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, l2norm, every=None, interpret=False):
    """Packed q, k, g [1, T, H, K], v [1, T, H, V], beta [1, T, H]; cu_seqlens [N + 1]; initial_state
    fp32 [N, H, K, V]. Returns (o [1, T, H, V] in v's dtype, final state fp32 [N, H, K, V], snapshots
    fp32 [T // every, H, K, V] or None). K and V powers of 2 of at least 16."""
    _, t, h, dk = q.shape
    dv = v.shape[-1]
    num_seqs = initial_state.shape[0]
    num_chunks = layout.num_chunks_bound(t, num_seqs, CHUNK, every)
    chunks = layout.chunk_layout(cu_seqlens, t, CHUNK, every, num_chunks)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))  # the kernels index [T, H, *]

    def rows_of(width):
        return jax.ShapeDtypeStruct((t, h, width), jnp.float32)

    w, u, qg, kg, aqk, decay = pl.pallas_call(
        functools.partial(_intra_kernel, l2norm=l2norm),
        grid=(num_chunks, h),
        out_shape=(rows_of(dk), rows_of(dv), rows_of(dk), rows_of(dk), rows_of(CHUNK),
                   jax.ShapeDtypeStruct((num_chunks, h, dk), jnp.float32)),
        # Eight warps: a program holds about 32K fp32 values (earlier blocks' keys, u and w rows).
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="kda_chunk_intra",
    )(_as_array(scale), chunks.start, chunks.length, q, k, v, g, beta)

    states = jax.ShapeDtypeStruct((num_seqs, h, dk, dv), jnp.float32)
    snapshots = [jax.ShapeDtypeStruct((t // every, h, dk, dv), jnp.float32)] if every else []
    width = min(STATE_COLUMNS, dv)
    o, final, *snapshot = pl.pallas_call(
        functools.partial(_state_kernel, width=width),
        grid=(num_seqs, h, dv // width),
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), states, *snapshots),
        # Sizes checked with Triton 3.9 and ptxas for sm_90a: no spills to speak of (4 bytes) with
        # 16-row steps and eight warps; num_stages=2 would buffer each step's loads in shared memory.
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="kda_chunk_state",
    )(chunks.start, chunks.length, chunks.snapshot, chunks.seq_first, chunks.seq_chunks,
      w, u, qg, kg, aqk, decay, initial_state)
    return o[None], final, snapshot[0] if every else None


def _recurrent_kernel(scale_ref, cu_ref, snapshot_first_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, initial_ref,
                      o_ref, final_ref, *snapshot_out, l2norm, every, width):
    seq, head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    columns = pl.ds(block * width, width)
    begin, scale = cu_ref[seq], scale_ref[0]

    def token(t, state):
        q, k, g = (ref[t, head, :].astype(jnp.float32) for ref in (q_ref, k_ref, g_ref))
        if l2norm:
            q, k = _l2_normalize(q), _l2_normalize(k)
        state = jnp.exp(g)[:, None] * state
        error = v_ref[t, head, columns].astype(jnp.float32) - jnp.sum(k[:, None] * state, axis=0)
        state = state + k[:, None] * (beta_ref[t, head].astype(jnp.float32) * error)[None, :]
        o_ref[t, head, columns] = jnp.sum((scale * q)[:, None] * state, axis=0).astype(o_ref.dtype)
        if snapshot_out:
            position = t - begin + 1
            row = snapshot_first_ref[seq] + position // every - 1
            plgpu.store(snapshot_out[0].at[jnp.maximum(row, 0), head, :, columns], state,
                        mask=jnp.full(state.shape, position % every == 0))
        return state

    state = initial_ref[seq, head, :, columns]
    final_ref[seq, head, :, columns] = jax.lax.fori_loop(begin, cu_ref[seq + 1], token, state)


def fused_recurrent_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, l2norm, every=None,
                        interpret=False):
    """The token loop, for decode; same arguments and results as chunk_kda."""
    _, t, h, dk = q.shape
    dv = v.shape[-1]
    num_seqs = initial_state.shape[0]
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))  # the kernel indexes [T, H, *]
    snapshot_first = layout.snapshot_offsets(cu_seqlens, every) if every else jnp.zeros((num_seqs,), jnp.int32)
    states = jax.ShapeDtypeStruct((num_seqs, h, dk, dv), jnp.float32)
    snapshots = [jax.ShapeDtypeStruct((t // every, h, dk, dv), jnp.float32)] if every else []
    width = min(STATE_COLUMNS, dv)
    o, final, *snapshot = pl.pallas_call(
        functools.partial(_recurrent_kernel, l2norm=l2norm, every=every, width=width),
        grid=(num_seqs, h, dv // width),
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), states, *snapshots),
        compiler_params=plgpu.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="kda_recurrent",
    )(_as_array(scale), cu_seqlens, snapshot_first, q, k, v, g, beta, initial_state)
    return o[None], final, snapshot[0] if every else None
