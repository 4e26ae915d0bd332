"""AttnRes against a NumPy implementation of ARCHITECTURE.md, "AttnRes", written from the text."""

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers import attn_res

EPS = 1e-5


def np_mix(sources, gamma, q):
    """sources [N, H] float64 -> mixture [H]: softmax over r_i * <gamma*q, v_i>, raw sources mixed."""
    r = 1.0 / np.sqrt(np.mean(sources ** 2, axis=-1) + EPS)
    z = r * (sources @ (gamma * q))
    a = np.exp(z - z.max())
    a /= a.sum()
    return a @ sources


def np_stack(emb, attn_fns, ffn_fns, reads, out_read, block):
    """Runs the AttnRes stack per token with explicit Python lists (bank, open block, pending output)."""
    p, d, bank = emb, None, []
    inputs = []
    for l in range(len(attn_fns)):
        if d is not None:
            p = p + d
        rows_before = list(bank)
        if l % block == 0:
            bank.append(p)
        x_attn = np_mix(np.stack(rows_before + [p]), *reads[l][0])
        a = attn_fns[l](x_attn)
        p = a if l % block == 0 else p + a
        x_ffn = np_mix(np.stack(bank + [p]), *reads[l][1])
        d = ffn_fns[l](x_ffn)
        inputs.append((x_attn, x_ffn))
    p = p + d
    return np_mix(np.stack(bank + [p]), *out_read), inputs


def test_stack_matches_numpy_over_several_blocks():
    rng = np.random.default_rng(0)
    h, layers, block = 16, 7, 3
    emb = rng.standard_normal(h)
    mats = [rng.standard_normal((h, h)) / np.sqrt(h) for _ in range(2 * layers)]
    attn_fns = [lambda x, m=mats[2 * l]: np.tanh(x @ m) for l in range(layers)]
    ffn_fns = [lambda x, m=mats[2 * l + 1]: np.tanh(x @ m) for l in range(layers)]
    reads = [[(1 + 0.1 * rng.standard_normal(h), rng.standard_normal(h) / 4) for _ in range(2)] for _ in range(layers)]
    out_read = (1 + 0.1 * rng.standard_normal(h), rng.standard_normal(h) / 4)
    expected, expected_inputs = np_stack(emb, attn_fns, ffn_fns, reads, out_read, block)

    def query(g, q):
        r = attn_res.AttnResQuery(h, dtype=jnp.float32, rngs=None)
        r.norm[...] = jnp.asarray(g, jnp.float32)
        r.proj[...] = jnp.asarray(q, jnp.float32)
        return r

    with jax.default_matmul_precision("highest"):
        stream = attn_res.start_stream(jnp.asarray(emb, jnp.float32)[None, None], -(-layers // block))
        for l in range(layers):
            stream, mix_a = attn_res.attention_read(stream, jnp.int32(l), block, query(*reads[l][0]), EPS)
            np.testing.assert_allclose(mix_a[0, 0], expected_inputs[l][0], rtol=1e-5, atol=1e-6)
            a = jnp.asarray(attn_fns[l](np.asarray(mix_a[0, 0], np.float64)), jnp.float32)[None, None]
            stream, mix_f = attn_res.ffn_read(stream, a, jnp.int32(l), block, query(*reads[l][1]), EPS)
            np.testing.assert_allclose(mix_f[0, 0], expected_inputs[l][1], rtol=1e-5, atol=1e-6)
            d = jnp.asarray(ffn_fns[l](np.asarray(mix_f[0, 0], np.float64)), jnp.float32)[None, None]
            stream = stream._replace(d=d)
        out = attn_res.final_read(stream, query(*out_read), EPS)
    np.testing.assert_allclose(out[0, 0], expected, rtol=1e-5, atol=1e-6)


def test_first_read_is_the_embedding():
    emb = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 8)), jnp.float32)
    r = attn_res.AttnResQuery(8, dtype=jnp.float32, rngs=None)
    r.proj[...] = jnp.ones(8)
    _, mix = attn_res.attention_read(attn_res.start_stream(emb, 2), jnp.int32(0), 4, r, EPS)
    np.testing.assert_array_equal(mix, emb)  # one source: softmax weight exactly 1
