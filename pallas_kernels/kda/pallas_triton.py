"""KDA in Pallas on the Triton backend (NVIDIA, and AMD through ROCm): chunked prefill and the token loop.

Both take packed sequences (B = 1, `cu_seqlens`); api.py packs a batch of equal-length rows.

Chunked form, per head and chunk of C = chunk_size tokens (64 by default, as in xla.py, whose
algebra this is), in two kernels:
1. `_intra_kernel`, one program per (chunk, head), all in parallel: the in-chunk cumulative log
   decay G, the scores Akk = beta k k^T and Aqk = q k^T decayed per channel, the solve
   (I + Akk)^-1 applied to beta v and beta k exp(G), giving u and w, and the decayed q exp(G) and
   k exp(G_last - G). Written to HBM in fp32, token-major like the inputs.
2. `_state_kernel`, one program per (sequence, head, block_v columns of the state): the loop over
   the sequence's chunks, holding its fp32 [K, block_v] state tile:
       v' = u - w S;   o = (q exp(G)) S + Aqk v';   S <- exp(G_last) S + (k exp(G_last - G))^T v'.
Chunks come from layout.py: they never span two sequences, and ragged ends are masked loads and
stores.

Decays are only ever exp of a non-positive number. A chunk is C / 16 blocks of BLOCK = 16 rows. For
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

Tuning knobs (chunk size, tile sizes, warps, stages) are keyword arguments of the public functions.
Their defaults were chosen by compiling the lowered kernels with Triton 3.9 for sm_90a (ptxas -v)
and gfx942 at K = V = 128: all three compile. Spills per thread: the token loop none; the state
loop 4 bytes on sm_90a, 18 registers on gfx942; the intra kernel about 260 bytes on sm_90a, none on
gfx942. The kernels index whole arrays (no BlockSpecs): each ref is annotated with the array it
holds and the tiles a program reads or writes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import layout
from pallas_kernels.kda.reference import L2_NORM_EPS

BLOCK = 16  # rows per block of a chunk: the smallest tile a tensor-core product takes
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


def _intra_kernel(
    scale_ref,   # [1] fp32
    start_ref,   # [M] int32, M chunks: a chunk's first row
    length_ref,  # [M] int32: its tokens (0 for the unused chunks of the static bound M)
    q_ref,       # [T, H, K], read as [BLOCK, K] blocks of the chunk, one head
    k_ref,       # [T, H, K], likewise
    v_ref,       # [T, H, V], read as [BLOCK, V] blocks
    g_ref,       # [T, H, K], read as [BLOCK, K] blocks
    beta_ref,    # [T, H], read as [BLOCK] blocks
    w_ref,       # [T, H, K] fp32, written as [BLOCK, K] blocks
    u_ref,       # [T, H, V] fp32, written as [BLOCK, V] blocks
    qg_ref,      # [T, H, K] fp32: q exp(G), written as [BLOCK, K] blocks
    kg_ref,      # [T, H, K] fp32: k exp(G_last - G), likewise
    aqk_ref,     # [T, H, C] fp32: each row's scores against its chunk's keys, written as [BLOCK, BLOCK] tiles
    decay_ref,   # [M, H, K] fp32: exp(G_last), written as one [K] row
    *,
    l2norm: bool,
    blocks: int,  # C // BLOCK
):
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
    for a in range(blocks):
        befores.append(befores[-1] + jnp.sum(load(g_ref, a), axis=0))
    rows, cols = jnp.arange(BLOCK)[:, None], jnp.arange(BLOCK)[None, :]

    akk, inverse = {}, {}
    for a in range(blocks):
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
        for b in range(a + 1, blocks):
            store(aqk_ref, a, jnp.zeros((BLOCK, BLOCK)), pl.ds(b * BLOCK, BLOCK))
        store(qg_ref, a, q * jnp.exp(g_cum))
        store(kg_ref, a, k * jnp.exp(jnp.minimum(befores[-1] - g_cum, 0.0)))
        # Row a of X by block forward substitution: X_ab = -X_aa sum_{b <= c < a} Akk_ac X_cb.
        inverse[a, a] = _unit_lower_inverse(beta * jnp.where(rows > cols, kk, 0.0))
        for b in range(a):
            inner = functools.reduce(jnp.add, [_dot(akk[a, c], inverse[c, b]) for c in range(b, a)])
            inverse[a, b] = -_dot(inverse[a, a], inner)

    for a in range(blocks):
        u = w = None
        for b in range(a + 1):
            k, head_sum = keys_of(b)
            x_beta = inverse[a, b] * load_beta(b)[None, :]
            u_part, w_part = _dot(x_beta, load(v_ref, b)), _dot(x_beta, k * jnp.exp(befores[b] + head_sum))
            u, w = (u_part, w_part) if u is None else (u + u_part, w + w_part)
        store(u_ref, a, u)
        store(w_ref, a, w)
    decay_ref[chunk, head, :] = jnp.exp(befores[-1])


def _state_kernel(
    start_ref,       # [M] int32, M chunks: a chunk's first row
    length_ref,      # [M] int32: its tokens
    seq_first_ref,   # [N] int32: a sequence's first chunk
    seq_chunks_ref,  # [N] int32: its chunks
    w_ref,           # [T, H, K] fp32, read as [state_rows, K] tiles
    u_ref,           # [T, H, V] fp32, read as [state_rows, block_v] tiles
    qg_ref,          # [T, H, K] fp32, read as [state_rows, K] tiles
    kg_ref,          # [T, H, K] fp32, likewise
    aqk_ref,         # [T, H, C] fp32, read as [state_rows, state_rows] tiles
    decay_ref,       # [M, H, K] fp32, read as one [K] row
    initial_ref,     # [N, H, K, V] fp32, read as one [K, block_v] tile
    o_ref,           # [T, H, V], written as [state_rows, block_v] tiles
    final_ref,       # [N, H, K, V] fp32, written as one [K, block_v] tile
    *,
    chunk_size: int,
    state_rows: int,
    block_v: int,
):
    seq, head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    columns = pl.ds(block * block_v, block_v)

    def chunk_step(chunk, state):  # state: fp32 [K, block_v]
        start, length = start_ref[chunk], length_ref[chunk]
        writes = []  # v' of the row blocks so far, [state_rows, block_v] each
        for a in range(chunk_size // state_rows):
            rows = pl.ds(start + a * state_rows, state_rows)
            valid = a * state_rows + jnp.arange(state_rows) < length
            w = _load_rows(w_ref, rows, head, valid)
            writes.append(_load_rows(u_ref, rows, head, valid, columns) - _dot(w, state))
            o = _dot(_load_rows(qg_ref, rows, head, valid), state)
            for b in range(a + 1):  # Aqk is block lower triangular
                aqk = _load_rows(aqk_ref, rows, head, valid, pl.ds(b * state_rows, state_rows))
                o += _dot(aqk, writes[b])
            _store_rows(o_ref, rows, head, valid, o, columns)
        state = decay_ref[chunk, head, :][:, None] * state
        for a in range(chunk_size // state_rows):
            rows = pl.ds(start + a * state_rows, state_rows)
            valid = a * state_rows + jnp.arange(state_rows) < length
            state += _dot_tn(_load_rows(kg_ref, rows, head, valid), writes[a])
        return state

    first = seq_first_ref[seq]
    state = initial_ref[seq, head, :, columns]
    final_ref[seq, head, :, columns] = jax.lax.fori_loop(first, first + seq_chunks_ref[seq], chunk_step, state)


@functools.partial(jax.jit, static_argnames=("l2norm", "chunk_size", "state_rows", "block_v", "num_warps",
                                             "num_stages", "interpret"))
def chunk_kda(
    q,              # [1, T, H, K]
    k,              # [1, T, H, K]
    v,              # [1, T, H, V]
    g,              # [1, T, H, K]
    beta,           # [1, T, H]
    *,
    scale,          # a scalar, may be traced
    initial_state,  # [N, H, K, V] fp32
    cu_seqlens,     # [N + 1] int32
    l2norm: bool,
    chunk_size: int = 64,
    state_rows: int = 16,
    block_v: int = 32,
    num_warps: int = 8,
    num_stages: int = 1,
    interpret: bool = False,
):
    """Packed sequences. Returns (o [1, T, H, V] in v's dtype, final state fp32 [N, H, K, V]). K and V
    powers of 2 of at least 16.

    chunk_size: tokens per chunk, a multiple of 16 and of state_rows (the intra kernel unrolls its
    16-row blocks and holds (chunk_size / 16)^2 tiles of the inverse). state_rows: rows the state
    loop takes at a time, to bound the registers it holds (a power of 2 >= 16). block_v: the state
    columns one program of the state loop holds (a power of 2, at most V). num_warps, num_stages:
    both kernels'. Eight warps: an intra program holds about 32K fp32 values (earlier blocks' keys,
    u and w rows), and the state loop does not spill to speak of (4 bytes on sm_90a) with 16-row
    steps; a second stage would buffer each step's loads in shared memory."""
    _, t, h, dk = q.shape
    dv = v.shape[-1]
    num_seqs = initial_state.shape[0]
    num_chunks = layout.num_chunks_bound(t, num_seqs, chunk_size)
    chunks = layout.chunk_layout(cu_seqlens, chunk_size, num_chunks)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))  # the kernels index [T, H, *]

    def rows_of(width):
        return jax.ShapeDtypeStruct((t, h, width), jnp.float32)

    w, u, qg, kg, aqk, decay = pl.pallas_call(
        functools.partial(_intra_kernel, l2norm=l2norm, blocks=chunk_size // BLOCK),
        grid=(num_chunks, h),
        out_shape=(rows_of(dk), rows_of(dv), rows_of(dk), rows_of(dk), rows_of(chunk_size),
                   jax.ShapeDtypeStruct((num_chunks, h, dk), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_chunk_intra",
    )(_as_array(scale), chunks.start, chunks.length, q, k, v, g, beta)

    states = jax.ShapeDtypeStruct((num_seqs, h, dk, dv), jnp.float32)
    block_v = min(block_v, dv)
    o, final = pl.pallas_call(
        functools.partial(_state_kernel, chunk_size=chunk_size, state_rows=state_rows, block_v=block_v),
        grid=(num_seqs, h, dv // block_v),
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), states),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_chunk_state",
    )(chunks.start, chunks.length, chunks.seq_first, chunks.seq_chunks, w, u, qg, kg, aqk, decay, initial_state)
    return o[None], final


def _recurrent_kernel(
    scale_ref,    # [1] fp32
    cu_ref,       # [N + 1] int32
    q_ref,        # [T, H, K], read as one [K] row per token
    k_ref,        # [T, H, K], likewise
    v_ref,        # [T, H, V], read as one [block_v] row per token
    g_ref,        # [T, H, K], read as one [K] row per token
    beta_ref,     # [T, H], one value per token
    initial_ref,  # [N, H, K, V] fp32, read as one [K, block_v] tile
    o_ref,        # [T, H, V], written as one [block_v] row per token
    final_ref,    # [N, H, K, V] fp32, written as one [K, block_v] tile
    *,
    l2norm: bool,
    block_v: int,
):
    seq, head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    columns = pl.ds(block * block_v, block_v)
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


@functools.partial(jax.jit, static_argnames=("l2norm", "block_v", "num_warps", "num_stages", "interpret"))
def fused_recurrent_kda(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, l2norm: bool, block_v: int = 32,
                        num_warps: int = 2, num_stages: int = 1, interpret: bool = False):
    """The token loop, for decode; same arguments and results as chunk_kda. block_v: the state
    columns one program holds (a power of 2, at most V)."""
    h, dk = q.shape[2:]
    dv = v.shape[-1]
    num_seqs = initial_state.shape[0]
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))  # the kernel indexes [T, H, *]
    states = jax.ShapeDtypeStruct((num_seqs, h, dk, dv), jnp.float32)
    block_v = min(block_v, dv)
    o, final = pl.pallas_call(
        functools.partial(_recurrent_kernel, l2norm=l2norm, block_v=block_v),
        grid=(num_seqs, h, dv // block_v),
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), states),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_recurrent",
    )(_as_array(scale), cu_seqlens, q, k, v, g, beta, initial_state)
    return o[None], final
