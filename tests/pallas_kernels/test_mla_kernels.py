"""MLA kernels: every implementation (XLA, Pallas-Triton in interpret mode) against reference.py for
padded and packed prefill, for paged decode and extend over bf16 and fp8 pages and for the paged
naive-form prefill, the edge cases (ragged
blocks, length 1 and 0, queries seeing no key, pages ending on the length, garbage table entries),
the API's checks, and lowering for an H200 and an MI300 at K3's per-device shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla
from pallas_kernels.mla import pallas_triton, reference, xla
from tests.pallas_kernels.gpu_lowering import lower_for_gpu, triton_call_count

# Tolerances, relative to the largest |v| (every output is a convex mix of v rows):
# f32: both sides accumulate fp32 in different orders, a few 2**-24 per step; 1e-5 leaves ample room.
# bf16: the kernels round the softmax weights to bf16 for the value dot (2**-9 relative each, so at
# most 2**-9 max|v| in the mix) and the output to bf16 (2**-9 |out|): 2**-7 allows twice both.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2.0 ** -7}
E4M3_REL, E4M3_ABS = 2.0 ** -4, 2.0 ** -10  # e4m3 rounding: 3 mantissa bits; subnormal spacing 2**-9
# 16-row query and key blocks, so that small shapes span several blocks with ragged ends.
SMALL_BLOCKS = {"block_q": 16, "block_k": 16}
# Two pages per split, so a 5-page table spans three splits, one of them partly empty.
SMALL_SPLITS = {"min_pages_per_split": 2}


def assert_mix_close(got, want, v, dtype):
    atol = TOL[dtype] * float(np.nanmax(np.abs(np.asarray(v, np.float64))))  # unwritten rows are NaN
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=0, atol=atol)


def normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def test_column_pieces_split_into_powers_of_two():
    assert pallas_triton.column_pieces(192) == ((0, 128), (128, 64))
    assert pallas_triton.column_pieces(576) == ((0, 512), (512, 64))
    assert pallas_triton.column_pieces(128) == ((0, 128),)


# ------------------------------------------------------------------------------------------- prefill

def padded_inputs(dtype, b=3, t=37, s=53, h=2, dqk=48, dv=32, seed=0):
    """Dqk = 48 splits as 32 + 16, like K3's 192 = 128 + 64."""
    rng = np.random.default_rng(seed)
    return normal(rng, (b, t, h, dqk), dtype), normal(rng, (b, s, h, dqk), dtype), normal(rng, (b, s, h, dv), dtype)


# Per row: a chunk after a cached prefix of 16 (keys = prefix + chunk); a plain prefill whose last
# key block is partial; queries before any key (negative offset: the first 5 see nothing) with
# kv_length 0 past the last one.
PADDED_CASES = {"q_offset": [16, 0, -5], "kv_length": [53, 37, 20]}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_padded_prefill_matches_reference(dtype, impl):
    q, k, v = padded_inputs(dtype)
    kw = {"q_offset": jnp.asarray(PADDED_CASES["q_offset"]), "kv_length": jnp.asarray(PADDED_CASES["kv_length"]),
          "scale": 0.2}
    want = reference.causal_attention(q, k, v, **kw)
    got = (xla.causal_attention(q, k, v, kv_block=16, **kw) if impl == "xla"
           else mla.causal_attention(q, k, v, impl="pallas", **SMALL_BLOCKS, **kw))
    assert got.dtype == q.dtype and got.shape == want.shape
    assert_mix_close(got, want, v, dtype)
    assert not np.asarray(got[2, :5], np.float32).any()  # queries that see no key give zeros


def test_padded_prefill_single_query_and_empty_row():
    """T = 1 with the default blocks; a row with kv_length 0."""
    q, k, v = padded_inputs(jnp.float32, b=2, t=1, s=9)
    kw = {"q_offset": jnp.asarray([8, 0]), "kv_length": jnp.asarray([9, 0]), "scale": 0.3}
    got = mla.causal_attention(q, k, v, impl="pallas", **kw)
    assert_mix_close(got, reference.causal_attention(q, k, v, **kw), v, jnp.float32)
    assert not np.asarray(got[1]).any()


def packed_inputs(dtype, q_lens, k_lens, tail_q=3, tail_k=2, h=2, dqk=48, dv=32, seed=1):
    """Packed rows plus unowned rows after the last sequence; cu_seqlens int32 [N + 1]."""
    rng = np.random.default_rng(seed)
    tq, tk = sum(q_lens) + tail_q, sum(k_lens) + tail_k
    cu = lambda lens: jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    return (normal(rng, (tq, h, dqk), dtype), normal(rng, (tk, h, dqk), dtype), normal(rng, (tk, h, dv), dtype),
            cu(q_lens), cu(k_lens))


# Sequences: a chunk of 20 after 17 cached tokens; a plain prefill ending on a block boundary (32);
# length 1; a sequence with no new query (q_len 0, k_len 5); a single decode-like query after 40.
Q_LENS, K_LENS = [20, 32, 1, 0, 1], [37, 32, 1, 5, 41]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["xla", "pallas", "pallas_max_seqlen"])
def test_packed_prefill_matches_reference(dtype, impl):
    q, k, v, cu_q, cu_k = packed_inputs(dtype, Q_LENS, K_LENS)
    kw = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "scale": 0.2}
    want = reference.varlen_causal_attention(q, k, v, **kw)
    if impl == "xla":
        got = xla.varlen_causal_attention(q, k, v, kv_block=16, **kw)
    else:
        got = mla.varlen_causal_attention(q, k, v, impl="pallas", **SMALL_BLOCKS, **kw,
                                          max_seqlen_q=max(Q_LENS) if impl == "pallas_max_seqlen" else None)
    assert got.dtype == q.dtype and got.shape == want.shape
    assert_mix_close(got, want, v, dtype)
    assert not np.asarray(got[sum(Q_LENS):], np.float32).any()  # rows past the last sequence


def test_packed_reference_equals_numpy_per_sequence():
    """The packed reference against a float64 NumPy loop: sequence n's query i sees its keys
    0..k_len - q_len + i; rows past the last sequence are zero."""
    q, k, v, cu_q, cu_k = (np.asarray(x, np.float64) for x in packed_inputs(jnp.float32, Q_LENS, K_LENS))
    want = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for n, (q_len, k_len) in enumerate(zip(Q_LENS, K_LENS)):
        q0, k0 = int(cu_q[n]), int(cu_k[n])
        for i in range(q_len):
            seen = slice(k0, k0 + k_len - q_len + i + 1)
            logits = np.einsum("hd,shd->hs", q[q0 + i], k[seen]) * 0.2
            p = np.exp(logits - logits.max(-1, keepdims=True))
            want[q0 + i] = np.einsum("hs,shd->hd", p / p.sum(-1, keepdims=True), v[seen])
    got = reference.varlen_causal_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
                                            cu_seqlens_q=jnp.asarray(cu_q, jnp.int32),
                                            cu_seqlens_k=jnp.asarray(cu_k, jnp.int32), scale=0.2)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)  # fp32 against float64 over <= 41 keys


# -------------------------------------------------------------------------------------------- decode

def paged_inputs(page_size, lengths, *, heads=3, width=80, max_pages=5, pages_dtype=jnp.bfloat16, kv_scale=None,
                 seed=2):
    """q [B, heads, width] bf16; a pool whose page 0 is all NaN (unwritten); each sequence owns
    distinct shuffled pages for its length, and table entries past it point at page 0. The rows
    after the length in the last page are NaN too. Stored values are true values / kv_scale."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    num_pages = 1 + b * max_pages
    true_rows = rng.standard_normal((num_pages, page_size, width))
    owned = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((b, max_pages), np.int32)
    true_rows[0] = np.nan
    for i, length in enumerate(lengths):
        used = -(-length // page_size)
        table[i, :used] = owned[i * max_pages:i * max_pages + used]
        if length % page_size:
            true_rows[table[i, used - 1], length % page_size:] = np.nan
    stored = jnp.asarray(true_rows / (kv_scale or 1.0), jnp.float32).astype(pages_dtype)
    q = normal(rng, (b, heads, width), jnp.bfloat16)
    return q, stored, jnp.asarray(table), jnp.asarray(lengths, jnp.int32), true_rows


# Lengths: empty (padding row), 1, ending exactly on a page boundary, ragged, the full table.
LENGTHS_16 = [0, 1, 32, 45, 80]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_decode_bf16_matches_reference(impl, page_size):
    lengths = [n * page_size // 16 for n in LENGTHS_16]
    q, pages, table, lengths, _ = paged_inputs(page_size, lengths)
    kw = {"scale": 0.1, "value_width": 64}
    want = reference.paged_decode_attention(q, pages, table, lengths, **kw)
    got = (xla.paged_decode_attention(q, pages, table, lengths, kv_block=32, **kw) if impl == "xla"
           else mla.paged_decode_attention(q, pages, table, lengths, impl="pallas", **SMALL_SPLITS, **kw))
    assert got.dtype == q.dtype and got.shape == (5, 3, 64)
    assert_mix_close(got, want, pages[1:, :, :64].astype(jnp.float32), jnp.bfloat16)
    assert not np.asarray(got[0], np.float32).any()  # length 0 gives zeros


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_paged_decode_fp8_matches_reference(impl):
    """The same stored fp8 values on both sides: e4m3 is exact in bf16 and fp32, so the bf16 bound holds."""
    kv_scale = 0.25
    q, pages, table, lengths, _ = paged_inputs(16, LENGTHS_16, pages_dtype=jnp.float8_e4m3fn, kv_scale=kv_scale)
    kw = {"scale": 0.1, "value_width": 64, "kv_scale": jnp.float32(kv_scale)}
    want = reference.paged_decode_attention(q, pages, table, lengths, **kw)
    fn = functools.partial(xla.paged_decode_attention, kv_block=32) if impl == "xla" else functools.partial(
        mla.paged_decode_attention, impl="pallas", **SMALL_SPLITS)
    got = fn(q, pages, table, lengths, **kw)
    assert_mix_close(got, want, pages[1:, :, :64].astype(jnp.float32) * kv_scale, jnp.bfloat16)


def test_fp8_pages_approximate_the_true_values():
    """fp8 pages with kv_scale against the fp32 true values. Each stored entry times kv_scale is
    within E4M3_REL |x| + E4M3_ABS kv_scale of the truth, so each logit moves by at most
    delta = scale * sum_c |q_c| (E4M3_REL |k_c| + E4M3_ABS kv_scale); softmax weights then change by
    a factor within e^(+-2 delta), and the mixed values by the per-element bound."""
    kv_scale, scale = 0.25, 0.02
    q, pages, table, lengths, true_rows = paged_inputs(16, LENGTHS_16[1:], pages_dtype=jnp.float8_e4m3fn,
                                                       kv_scale=kv_scale)
    got = mla.paged_decode_attention(q, pages, table, lengths, scale=scale, value_width=64,
                                     kv_scale=jnp.float32(kv_scale), impl="pallas")
    truth = jnp.asarray(np.nan_to_num(true_rows), jnp.float32)
    want = reference.paged_decode_attention(q, truth, table, lengths, scale=scale, value_width=64)
    magnitude = np.abs(np.nan_to_num(true_rows))
    delta = scale * float(np.abs(np.asarray(q, np.float64)).sum(-1).max()
                          * (E4M3_REL * magnitude.max() + E4M3_ABS * kv_scale))
    v_max = magnitude[..., :64].max()
    atol = v_max * (np.expm1(2 * delta) + E4M3_REL + TOL[jnp.bfloat16]) + E4M3_ABS * kv_scale
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=0, atol=atol)


def test_contiguous_latent_decode_through_the_paged_kernel():
    """latent_decode_attention (the model's call) with impl="pallas": S = 70 is padded to whole pages, S = 48 is
    viewed as pages of 16 rows."""
    rng = np.random.default_rng(4)
    for s, lengths in ((70, [70, 64]), (48, [48, 17])):
        q, cache = normal(rng, (2, 3, 80), jnp.bfloat16), normal(rng, (2, s, 80), jnp.bfloat16)
        kw = {"kv_length": jnp.asarray(lengths), "scale": 0.1, "value_width": 64}
        got = mla.latent_decode_attention(q, cache, impl="pallas", **kw)
        assert_mix_close(got, reference.latent_decode_attention(q, cache, **kw), cache[..., :64], jnp.bfloat16)


# ---------------------------------------------------- paged extend and prefill (T new tokens per row)

T_NEW = 6  # new tokens per row: each row's last T_NEW positions (fewer for shorter rows: some see nothing)


def extend_inputs(dtype, *, pages_dtype=jnp.bfloat16, kv_scale=None, lengths=(0, 1, 32, 45, 80)):
    """paged_inputs' pool and tables (NaN in page 0 and past each length) with queries [B, T_NEW, 3, 80]
    at positions length - T_NEW + t."""
    _, pages, table, lengths, true_rows = paged_inputs(16, list(lengths), pages_dtype=pages_dtype,
                                                       kv_scale=kv_scale)
    q = normal(np.random.default_rng(5), (len(lengths), T_NEW, 3, 80), dtype)
    return q, pages, table, lengths, lengths - T_NEW, true_rows


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("pages_dtype, kv_scale", [(jnp.bfloat16, None), (jnp.float8_e4m3fn, 0.25)])
def test_paged_extend_matches_reference(impl, pages_dtype, kv_scale):
    q, pages, table, lengths, q_offset, _ = extend_inputs(jnp.bfloat16, pages_dtype=pages_dtype, kv_scale=kv_scale)
    kw = {"q_offset": q_offset, "kv_length": lengths, "scale": 0.1, "value_width": 64,
          "kv_scale": None if kv_scale is None else jnp.float32(kv_scale)}
    want = reference.paged_extend_attention(q, pages, table, **kw)
    got = (xla.paged_extend_attention(q, pages, table, kv_block=32, **kw) if impl == "xla"
           else mla.paged_extend_attention(q, pages, table, impl="pallas", **SMALL_SPLITS, **kw))
    assert got.dtype == q.dtype and got.shape == (5, T_NEW, 3, 64)
    assert_mix_close(got, want, pages[1:, :, :64].astype(jnp.float32) * (kv_scale or 1.0), jnp.bfloat16)
    assert not np.asarray(got[0], np.float32).any()  # length 0: no query sees a key
    assert not np.asarray(got[1, :-1], np.float32).any()  # length 1: only the last query has one


def test_paged_extend_of_one_token_is_the_decode():
    q, pages, table, lengths, _, _ = extend_inputs(jnp.bfloat16)
    kw = {"scale": 0.1, "value_width": 64}
    want = reference.paged_decode_attention(q[:, 0], pages, table, lengths, **kw)
    got = reference.paged_extend_attention(q[:, :1], pages, table, q_offset=lengths - 1, kv_length=lengths, **kw)
    np.testing.assert_array_equal(np.asarray(got[:, 0], np.float32), np.asarray(want, np.float32))


def expansion_weights(heads=3, nope=32, v=32, latent=64, seed=6):
    """w_uk [H, nope, C_lat], w_uv [H, v, C_lat] for paged_inputs' 80-wide rows (64 latent + 16 shared key),
    scaled so that keys and values stay O(1)."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((heads, nope, latent)) / 8, jnp.float32),
            jnp.asarray(rng.standard_normal((heads, v, latent)) / 8, jnp.float32))


def expanded_values(true_rows, w_uv):
    """max |v| over the written rows (page 0 and the rows past each length are NaN)."""
    return float(np.nanmax(np.abs(np.einsum("psc,hvc->pshv", true_rows[..., :64], np.asarray(w_uv, np.float64)))))


@pytest.mark.parametrize("pages_dtype, kv_scale", [(jnp.bfloat16, None), (jnp.float8_e4m3fn, 0.25)])
def test_paged_prefill_matches_reference(pages_dtype, kv_scale):
    """fp32 queries over bf16 or fp8 pages (exact in fp32): the same true rows on both sides, so the
    fp32 bound holds; kv_block 32 spreads each context over up to 3 blocks of pages."""
    q, pages, table, lengths, q_offset, _ = extend_inputs(jnp.float32, pages_dtype=pages_dtype, kv_scale=kv_scale)
    q = q[..., :48]  # nope 32 + rope 16
    w_uk, w_uv = expansion_weights()
    kw = {"q_offset": q_offset, "kv_length": lengths, "scale": 0.1,
          "kv_scale": None if kv_scale is None else jnp.float32(kv_scale)}
    want = reference.paged_prefill_attention(q, pages, table, w_uk, w_uv, **kw)
    got = xla.paged_prefill_attention(q, pages, table, w_uk, w_uv, kv_block=32, **kw)
    assert got.dtype == q.dtype and got.shape == (5, T_NEW, 3, 32)
    true_rows = np.asarray(pages, np.float64) * (kv_scale or 1.0)
    true_rows[0] = np.nan
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=0,
                               atol=TOL[jnp.float32] * expanded_values(true_rows, w_uv))
    assert not np.asarray(got[0]).any() and not np.asarray(got[1, :-1]).any()
    with pytest.raises(ValueError, match="does not take these shapes"):
        mla.paged_prefill_attention(q, pages, table, w_uk, w_uv, impl="pallas", **kw)


def test_paged_prefill_and_extend_are_the_two_forms_of_one_attention():
    """The naive form (rows expanded per head) equals the absorbed form with the queries mapped into
    the latent space and the latent mix mapped out: W_UK^T q . row = q . (W_UK row), W_UV (sum p row)
    = sum p (W_UV row). fp32 throughout."""
    q, pages, table, lengths, q_offset, true_rows = extend_inputs(jnp.float32)
    q = q[..., :48]
    w_uk, w_uv = expansion_weights()
    kw = {"q_offset": q_offset, "kv_length": lengths, "scale": 0.1}
    naive = xla.paged_prefill_attention(q, pages, table, w_uk, w_uv, kv_block=32, **kw)
    q_latent = jnp.concatenate([jnp.einsum("hnc,bthn->bthc", w_uk, q[..., :32]), q[..., 32:]], -1)
    latent = xla.paged_extend_attention(q_latent, pages, table, value_width=64, kv_block=32, **kw)
    absorbed = jnp.einsum("bthc,hvc->bthv", latent, w_uv)
    np.testing.assert_allclose(np.asarray(absorbed), np.asarray(naive), rtol=0,
                               atol=TOL[jnp.float32] * expanded_values(true_rows, w_uv))


def test_paged_prefill_memory_follows_the_context_not_the_table_width():
    """A chunk over a page table 64 times wider (a long max_model_len, mostly unused) needs no more
    scratch memory than over a table just wide enough: the rows are expanded a block (kv_block
    tokens) at a time, and only the blocks up to the longest context are visited."""
    q, pages, _, lengths, q_offset, _ = extend_inputs(jnp.float32)
    q = q[..., :48]
    w_uk, w_uv = expansion_weights()

    def scratch_bytes(width):
        table = jnp.zeros((5, width), jnp.int32).at[:, :5].set(jnp.arange(1, 6))
        fn = jax.jit(functools.partial(xla.paged_prefill_attention, q_offset=q_offset, kv_length=lengths, scale=0.1,
                                       kv_block=64))
        return fn.lower(q, pages, table, w_uk, w_uv).compile().memory_analysis().temp_size_in_bytes

    narrow, wide = scratch_bytes(8), scratch_bytes(512)
    table_growth = 5 * 512 * 4 * 4  # the wider table and its padded, reshaped copies, a few times over
    assert wide - narrow <= table_growth, (narrow, wide)


# ----------------------------------------------------------------------------------------------- API

def test_auto_is_xla_off_gpu():
    q, k, v = padded_inputs(jnp.float32, b=1, t=4, s=4)
    kw = {"q_offset": jnp.asarray([0]), "kv_length": jnp.asarray([4]), "scale": 0.3}
    np.testing.assert_array_equal(mla.causal_attention(q, k, v, **kw), xla.causal_attention(q, k, v, **kw))


def test_bad_arguments_name_the_argument():
    q, pages, table, lengths, _ = paged_inputs(16, [3, 5])
    with pytest.raises(ValueError, match="unknown impl"):
        mla.paged_decode_attention(q, pages, table, lengths, scale=1.0, value_width=64, impl="cuda")
    with pytest.raises(ValueError, match="kv_scale"):
        mla.paged_decode_attention(q, pages.astype(jnp.float8_e4m3fn), table, lengths, scale=1.0, value_width=64)
    with pytest.raises(ValueError, match="page_table"):
        mla.paged_decode_attention(q, pages, table[:1], lengths, scale=1.0, value_width=64)
    with pytest.raises(ValueError, match="does not take these shapes"):  # value 48 is not 80's first piece
        mla.paged_decode_attention(q, pages, table, lengths, scale=1.0, value_width=48, impl="pallas")
    with pytest.raises(ValueError, match=r"q_latent \(2, 3, 80\) must be \[B, T, H, C\]"):
        mla.paged_extend_attention(q, pages, table, q_offset=lengths, kv_length=lengths, scale=1.0, value_width=64)
    with pytest.raises(ValueError, match="w_uk"):  # 3 heads of queries, 2 of weights
        mla.paged_prefill_attention(q[:, None, :, :48], pages, table, jnp.zeros((2, 32, 64)), jnp.zeros((2, 32, 64)),
                                    q_offset=lengths, kv_length=lengths, scale=1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        mla.varlen_causal_attention(jnp.zeros((4, 2, 16)), jnp.zeros((4, 2, 16)), jnp.zeros((4, 2, 16)),
                                    cu_seqlens_q=jnp.asarray([0, 4]), cu_seqlens_k=jnp.asarray([0, 2, 4]), scale=1.0)
    with pytest.raises(ValueError, match="does not take these shapes"):  # Dv 24 is not a power of 2
        mla.causal_attention(jnp.zeros((1, 2, 1, 16)), jnp.zeros((1, 2, 1, 16)), jnp.zeros((1, 2, 1, 24)),
                             q_offset=jnp.zeros(1, int), kv_length=jnp.ones(1, int), scale=1.0, impl="pallas")


# ------------------------------------------------------------------------------------------ lowering

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_prefill_lowers_at_k3_shapes(platform):
    """T = 2048, 8 heads (K3 at TP8), qk 192 = 128 + 64, v 128, bf16; padded and packed forms."""
    def padded(q, k, v, q_offset, kv_length):
        return pallas_triton.causal_attention(q, k, v, q_offset=q_offset, kv_length=kv_length, scale=0.07)

    def packed(q, k, v, cu_q, cu_k):
        return pallas_triton.varlen_causal_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, scale=0.07,
                                                     max_seqlen_q=2048)

    text = lower_for_gpu(padded, S((1, 2048, 8, 192), BF16), S((1, 2048, 8, 192), BF16), S((1, 2048, 8, 128), BF16),
                         S((1,), jnp.int32), S((1,), jnp.int32), platform=platform)
    assert triton_call_count(text) == 1
    text = lower_for_gpu(packed, S((4096, 8, 192), BF16), S((4096, 8, 192), BF16), S((4096, 8, 128), BF16),
                         S((3,), jnp.int32), S((3,), jnp.int32), platform=platform)
    assert triton_call_count(text) == 1


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("pages_dtype", [BF16, jnp.float8_e4m3fn])
def test_paged_decode_lowers_at_k3_shapes(platform, pages_dtype):
    """Batch 64 x 8K context in pages of 64 rows of 576 = 512 + 64, 8 heads."""
    def decode(q, pages, table, lengths, kv_scale):
        return pallas_triton.paged_decode_attention(q, pages, table, lengths, scale=0.07, value_width=512,
                                                    kv_scale=kv_scale)

    text = lower_for_gpu(decode, S((64, 8, 576), BF16), S((64 * 128 + 1, 64, 576), pages_dtype),
                         S((64, 128), jnp.int32), S((64,), jnp.int32), S((), jnp.float32), platform=platform)
    assert triton_call_count(text) == 1
