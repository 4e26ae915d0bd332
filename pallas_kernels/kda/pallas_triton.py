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
Chunks come from layout.py: they never span two sequences, and ragged ends are masked loads and
stores.

Decays are only ever exp of a non-positive number. A chunk is four blocks of BLOCK = 16 rows. For
rows i of block a and keys j of an earlier block, the decay exp(G_i - G_j) splits at R_a, the
cumulative decay just before block a, into exp(G_i - R_a) on the rows and exp(R_a - G_j) on the
keys, both <= 1, so the scores of a block pair are one tensor-core product. Pairs inside one block
take exp(G_i - G_j) directly, one key column at a time. The exponents are differences of
cumulative sums within one chunk, so they carry an absolute error of about |G| * 6e-8, |G| the
decay summed over the chunk (as in fla).

Products run on tensor cores with fp32 accuracy up to about 2^-16: each fp32 operand is split into
a bf16 value and a bf16 remainder and three bf16 products are summed in fp32 (BF16_BF16_F32_X3,
which Triton lowers for both vendors; plain TF32 would keep 10 bits). On CPU (interpret mode) the
products are exact fp32.

Tile sizes and warp counts were chosen by compiling the lowered kernels with Triton 3.9 for sm_90a
(ptxas -v) and gfx942 at K = V = 128: all three compile. Spills per thread: the token loop none;
the state loop 4 bytes on sm_90a, 18 registers on gfx942; the intra kernel about 260 bytes on
sm_90a, none on gfx942.
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
    """One chunk and head, in two passes over its blocks:
    1. the scores, q exp(G), k exp(G_last - G), and the [BLOCK, BLOCK] tiles of X = (I + Akk)^-1;
    2. u = X diag(beta) v and w = X diag(beta) k exp(G).
    Earlier blocks' inputs are loaded again where needed (from L1 or L2) rather than held, which
    would spill registers (ptxas for sm_90a)."""
    chunk, head = pl.program_id(0), pl.program_id(1)
    start, length, scale = start_ref[chunk], length_ref[chunk], scale_ref[0]

    def rows_of(a):
        return pl.ds(start + a * BLOCK, BLOCK), a * BLOCK + jnp.arange(BLOCK) < length

    def load(ref, a):
        span, valid = rows_of(a)
        return _load_rows(ref, span, head, valid)

    def store(ref, a, value, columns=slice(None)):
        span, valid = rows_of(a)
        _store_rows(ref, span, head, valid, value, columns)

    def load_beta(a):
        span, valid = rows_of(a)
        return plgpu.load(beta_ref.at[span, head], mask=valid, other=0).astype(jnp.float32)

    def keys_of(a):
        """Block a's keys, normalised if asked, and its in-block cumulative log decay G_i - R_a <= 0."""
        k = load(k_ref, a)
        return _l2_normalize(k) if l2norm else k, jnp.cumsum(load(g_ref, a), axis=0)

    # befores[a] = R_a, the log decay summed over the blocks before a; befores[-1] = G_last. One
    # order of summation for all of them, so that no difference of two is pushed above 0 by rounding.
    befores = [jnp.zeros((g_ref.shape[-1],), jnp.float32)]
    for a in range(BLOCKS):
        befores.append(befores[-1] + jnp.sum(load(g_ref, a), axis=0))
    rows, cols = jnp.arange(BLOCK)[:, None], jnp.arange(BLOCK)[None, :]

    akk, inverse = {}, {}
    for a in range(BLOCKS):
        k, head_sum = keys_of(a)
        q = load(q_ref, a)
        q = scale * (_l2_normalize(q) if l2norm else q)
        beta = load_beta(a)[:, None]
        g_cum = befores[a] + head_sum  # G_i
        row_decay = jnp.exp(head_sum)
        for b in range(a):  # earlier keys, reloaded, decayed by exp(R_a - G_j) <= 1
            key, key_head_sum = keys_of(b)
            key = key * jnp.exp(jnp.minimum(befores[a] - befores[b] - key_head_sum, 0.0))
            akk[a, b] = beta * _dot(k * row_decay, key.T)
            store(aqk_ref, a, _dot(q * row_decay, key.T), pl.ds(b * BLOCK, BLOCK))
        kk, qk = _diagonal_scores(q, k, head_sum)
        store(aqk_ref, a, qk, pl.ds(a * BLOCK, BLOCK))
        for b in range(a + 1, BLOCKS):
            store(aqk_ref, a, jnp.zeros((BLOCK, BLOCK)), pl.ds(b * BLOCK, BLOCK))
        store(qg_ref, a, q * jnp.exp(g_cum))
        store(kg_ref, a, k * jnp.exp(jnp.minimum(befores[-1] - g_cum, 0.0)))
        # Row a of X by block forward substitution: X_ab = -X_aa sum_{b <= c < a} Akk_ac X_cb.
        inverse[a, a] = _unit_lower_inverse(beta * jnp.where(rows > cols, kk, 0.0))
        for b in range(a):
            inner = functools.reduce(jnp.add, [_dot(akk[a, c], inverse[c, b]) for c in range(b, a)])
            inverse[a, b] = -_dot(inverse[a, a], inner)

    for a in range(BLOCKS):
        u = w = None
        for b in range(a + 1):
            k, head_sum = keys_of(b)
            x_beta = inverse[a, b] * load_beta(b)[None, :]
            u_part, w_part = _dot(x_beta, load(v_ref, b)), _dot(x_beta, k * jnp.exp(befores[b] + head_sum))
            u, w = (u_part, w_part) if u is None else (u + u_part, w + w_part)
        store(u_ref, a, u)
        store(w_ref, a, w)
    decay_ref[chunk, head, :] = jnp.exp(befores[-1])


def _state_kernel(start_ref, length_ref, seq_first_ref, seq_chunks_ref, w_ref, u_ref, qg_ref, kg_ref, aqk_ref,
                  decay_ref, initial_ref, o_ref, final_ref, *, width):
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
        return state

    first = seq_first_ref[seq]
    state = initial_ref[seq, head, :, columns]
    final_ref[seq, head, :, columns] = jax.lax.fori_loop(first, first + seq_chunks_ref[seq], chunk_step, state)


def chunk_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, l2norm, interpret=False):
    """Packed q, k, g [1, T, H, K], v [1, T, H, V], beta [1, T, H]; cu_seqlens [N + 1]; initial_state
    fp32 [N, H, K, V]. Returns (o [1, T, H, V] in v's dtype, final state fp32 [N, H, K, V]). K and V
    powers of 2 of at least 16."""
    _, t, h, dk = q.shape
    dv = v.shape[-1]
    num_seqs = initial_state.shape[0]
    num_chunks = layout.num_chunks_bound(t, num_seqs, CHUNK)
    chunks = layout.chunk_layout(cu_seqlens, CHUNK, num_chunks)
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
    width = min(STATE_COLUMNS, dv)
    o, final = pl.pallas_call(
        functools.partial(_state_kernel, width=width),
        grid=(num_seqs, h, dv // width),
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), states),
        # Sizes checked with Triton 3.9 and ptxas for sm_90a: no spills to speak of (4 bytes) with
        # 16-row steps and eight warps; num_stages=2 would buffer each step's loads in shared memory.
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="kda_chunk_state",
    )(chunks.start, chunks.length, chunks.seq_first, chunks.seq_chunks, w, u, qg, kg, aqk, decay, initial_state)
    return o[None], final


def _recurrent_kernel(scale_ref, cu_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, initial_ref, o_ref, final_ref, *,
                      l2norm, width):
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
        return state

    state = initial_ref[seq, head, :, columns]
    final_ref[seq, head, :, columns] = jax.lax.fori_loop(begin, cu_ref[seq + 1], token, state)


def fused_recurrent_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, l2norm, interpret=False):
    """The token loop, for decode; same arguments and results as chunk_kda."""
    h, dk = q.shape[2:]
    dv = v.shape[-1]
    num_seqs = initial_state.shape[0]
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))  # the kernel indexes [T, H, *]
    states = jax.ShapeDtypeStruct((num_seqs, h, dk, dv), jnp.float32)
    width = min(STATE_COLUMNS, dv)
    o, final = pl.pallas_call(
        functools.partial(_recurrent_kernel, l2norm=l2norm, width=width),
        grid=(num_seqs, h, dv // width),
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), states),
        compiler_params=plgpu.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="kda_recurrent",
    )(_as_array(scale), cu_seqlens, q, k, v, g, beta, initial_state)
    return o[None], final
