"""Gated MLA: NumPy reference of ARCHITECTURE.md, "Gated MLA", naive == absorbed, cache continuation,
and the kernels' paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import K3Config
from k3jax.decoder import Batch
from k3jax.layers import mla as mla_layer
from k3jax.layers.mla import MLACache, MLAPages, MultiHeadLatentAttention, absorbed_is_cheaper, rope_interleaved
from pallas_kernels import mla as mla_ops
from pallas_kernels.mla import reference, xla

RTOL = 2e-5  # fp32 end to end; differences are reassociation only


def _layer(**changes):
    cfg = K3Config.from_preset("k3-tiny").replace(**changes)
    return cfg, MultiHeadLatentAttention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))


def np_mla(layer, cfg, x):
    """Spec 2.5 in float64 for one sequence x [T, H] (NoPE)."""
    w = lambda lin: np.asarray(lin.kernel[...], np.float64).T  # [in, out]  # noqa: E731
    norm = lambda v, g: v / np.sqrt(np.mean(v ** 2, -1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(g[...])  # noqa
    t, heads = x.shape[0], cfg.num_attention_heads
    c_q = norm(x @ w(layer.q_a_proj), layer.q_a_layernorm.weight)
    q = (c_q @ w(layer.q_b_proj)).reshape(t, heads, cfg.qk_head_dim)
    kv = x @ w(layer.kv_a_proj_with_mqa)
    c_kv = norm(kv[:, :cfg.kv_lora_rank], layer.kv_a_layernorm.weight)
    k_r = kv[:, cfg.kv_lora_rank:]
    kvb = (c_kv @ w(layer.kv_b_proj)).reshape(t, heads, -1)
    k = np.concatenate([kvb[..., :cfg.qk_nope_head_dim], np.broadcast_to(k_r[:, None], (t, heads, k_r.shape[-1]))], -1)
    v = kvb[..., cfg.qk_nope_head_dim:]
    logits = np.einsum("thd,shd->hts", q, k) / np.sqrt(cfg.qk_head_dim)
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", p, v).reshape(t, -1)
    o = o / (1 + np.exp(-(x @ w(layer.g_proj))))
    return o @ w(layer.o_proj)


def test_prefill_matches_numpy():
    cfg, layer = _layer()
    x = np.random.default_rng(0).standard_normal((2, 9, cfg.hidden_size)).astype(np.float32)
    with jax.default_matmul_precision("highest"):
        out, _ = layer(jnp.asarray(x), None, _batch(2, 9, 0))
    for b in range(2):
        np.testing.assert_allclose(out[b], np_mla(layer, cfg, x[b].astype(np.float64)), rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("use_nope", [True, False])
def test_decode_absorbed_equals_prefill_naive(use_nope):
    cfg, layer = _layer(mla_use_nope=use_nope)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 7, cfg.hidden_size)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        full, _ = layer(x, MLACache.zeros(cfg, 2, 16, jnp.float32), _batch(2, 7, 0))
        cache = MLACache.zeros(cfg, 2, 16, jnp.float32)
        part, cache = layer(x[:, :4], cache, _batch(2, 4, 0))  # naive over the cache
        steps = [part]
        for t in range(4, 7):  # absorbed, one token at a time
            o, cache = layer(x[:, t:t + 1], cache, _batch(2, 1, t))
            steps.append(o)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=RTOL, atol=1e-5)


def _batch(b, t, offset, page_table=None):
    return Batch(jnp.ones((b, t), bool), jnp.full((b,), t, jnp.int32), jnp.full((b,), offset, jnp.int32),
                 page_table=page_table)


@pytest.mark.parametrize("form", ["absorbed", "naive"])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.float8_e4m3fn, 0.1)])
def test_pages_equal_a_contiguous_cache(dtype, tol, form, monkeypatch):
    """Chunks and decode steps through a page pool (pages out of order, page size 4, padding in a
    chunk) give the contiguous cache's outputs, in either form of the paged attention; fp8 pages within
    E4M3's 3-bit mantissa (2**-4 per value, averaged over the keys)."""
    monkeypatch.setattr(mla_layer, "absorbed_is_cheaper", lambda cfg, t: form == "absorbed")
    cfg, layer = _layer()
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 11, cfg.hidden_size)), jnp.float32)
    table = jnp.asarray([[5, 2, 7, 0], [1, 6, 3, 4]], jnp.int32)  # page 0 of row 0 unused: the null page
    table = table.at[0, 3].set(8)
    with jax.default_matmul_precision("highest"):
        want, _ = layer(x, MLACache.zeros(cfg, 2, 16, jnp.float32), _batch(2, 11, 0))
        pages = MLAPages.zeros(cfg, 9, 4, dtype)
        # first chunk: 6 real tokens in a chunk of 8 (2 padding)
        padded = jnp.concatenate([x[:, :6], x[:, 9:]], axis=1)  # padding: any values
        chunk = Batch(jnp.arange(8)[None] < 6, jnp.full((2,), 6, jnp.int32), jnp.zeros((2,), jnp.int32),
                      page_table=table)
        first, pages = layer(padded, pages, chunk)
        # the padding (positions 6, 7: rows 2, 3 of each row's second page) went to the null page
        stored = np.asarray(pages.pages.astype(jnp.float32))
        assert not stored[np.asarray(table[:, 1])][:, 2:].any() and stored[0, 2:].any()
        outs = [first[:, :6]]
        for t in range(6, 11):
            o, pages = layer(x[:, t:t + 1], pages, _batch(2, 1, t, table))
            outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), want, rtol=tol, atol=tol * np.abs(want).max())


def test_the_paged_form_follows_the_multiply_add_count():
    """Absorbed while T (C + C_lat) <= C_lat (nope + v) + T (nope + rope + v): K3 (512, 128, 64, 128) up
    to T = 170 (768 T <= 131072), k3-tiny (32, 16, 8, 16) up to T = 32 (32 T <= 1024)."""
    k3, tiny = K3Config.from_preset("kimi-k3"), K3Config.from_preset("k3-tiny")
    assert [absorbed_is_cheaper(k3, t) for t in (1, 170, 171)] == [True, True, False]
    assert [absorbed_is_cheaper(tiny, t) for t in (1, 32, 33)] == [True, True, False]


def test_fp8_pages_clamp_values_beyond_the_format():
    """Rows past E4M3's range (448 x scale) are stored as the range's end, not as NaN; the rest round."""
    cfg, _ = _layer()
    pages = MLAPages.zeros(cfg, 2, 4, jnp.float8_e4m3fn, scale=0.5)
    values = jnp.zeros((1, 2, cfg.mla_cache_width)).at[0, 0, :3].set(jnp.asarray([1e4, -300.0, 1.5]))
    stored = pages.write(jnp.ones((1, 2), jnp.int32), jnp.asarray([[0, 1]]), values)
    got = np.asarray(stored.pages[1], np.float32) * float(stored.scale)
    np.testing.assert_array_equal(got[0, :3], [448 * 0.5, -224.0, 1.5])  # 1e4 and -300 clamp; 1.5 is exact
    assert np.isfinite(got).all()


def test_rope_rotates_adjacent_pairs():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 8)), jnp.float32)
    pos = jnp.asarray([0, 1, 5])
    out = np.asarray(rope_interleaved(x, pos, 10000.0))
    ref = np.asarray(x).copy()
    for i, p in enumerate([0, 1, 5]):
        for j in range(4):
            a = p * 10000.0 ** (-2 * j / 8)
            e, o = x[i, 2 * j], x[i, 2 * j + 1]
            ref[i, 2 * j], ref[i, 2 * j + 1] = e * np.cos(a) - o * np.sin(a), o * np.cos(a) + e * np.sin(a)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_blocked_xla_attention_equals_reference():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 5, 3, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 40, 3, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 40, 3, 4)), jnp.float32)
    kw = dict(q_offset=jnp.asarray([30, 0]), kv_length=jnp.asarray([35, 3]), scale=0.3)
    np.testing.assert_allclose(xla.causal_attention(q, k, v, kv_block=16, **kw),
                               reference.causal_attention(q, k, v, **kw), rtol=1e-5, atol=1e-6)
    ql = jnp.asarray(rng.standard_normal((2, 3, 12)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((2, 40, 12)), jnp.float32)
    kw = dict(kv_length=jnp.asarray([40, 17]), scale=0.3, value_width=10)
    np.testing.assert_allclose(xla.latent_decode_attention(ql, cache, kv_block=16, **kw),
                               reference.latent_decode_attention(ql, cache, **kw), rtol=1e-5, atol=1e-6)


def test_api_rejects_bad_arguments():
    q = jnp.zeros((1, 2, 3, 8))
    with pytest.raises(ValueError, match="must be"):
        mla_ops.causal_attention(q, jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 4)), q_offset=jnp.zeros(1, int),
                                 kv_length=jnp.ones(1, int), scale=1.0)
    with pytest.raises(ValueError, match="unknown impl"):
        mla_ops.latent_decode_attention(jnp.zeros((1, 2, 4)), jnp.zeros((1, 3, 4)), kv_length=jnp.ones(1, int),
                                        scale=1.0, value_width=2, impl="cuda")
