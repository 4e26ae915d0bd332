"""KDA op: reference, chunked and recurrent paths against a float64 NumPy loop written from the math."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda, fused_recurrent_kda

H, K, V = 2, 16, 8


def np_kda(q, k, v, g, beta, scale, state=None, l2norm=False):
    """One sequence [T, H, *] in float64: S <- exp(g) S; S += k (beta (v - S^T k))^T; o = S^T (scale q)."""
    if l2norm:
        q = q / np.sqrt((q ** 2).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k ** 2).sum(-1, keepdims=True) + 1e-6)
    s = np.zeros((q.shape[1], q.shape[2], v.shape[2])) if state is None else state.astype(np.float64).copy()
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            s[h] *= np.exp(g[t, h])[:, None]
            s[h] += np.outer(k[t, h], beta[t, h] * (v[t, h] - s[h].T @ k[t, h]))
            out[t, h] = s[h].T @ (scale * q[t, h])
    return out, s


def make(t, b=1, seed=0, gate_scale=1.0):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((b, t, H, K)) for _ in range(2))
    v = rng.standard_normal((b, t, H, V))
    g = -gate_scale * rng.uniform(0, 1, (b, t, H, K))
    beta = rng.uniform(0, 1, (b, t, H))
    return q, k, v, g, beta


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


FP32 = dict(rtol=2e-5, atol=2e-5)  # fp32 accumulation over <= 130 steps of O(1) values


@pytest.mark.parametrize("t", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_matches_numpy(fn, impl, t):
    q, k, v, g, beta = make(t, b=2, seed=t)
    q, k = unit(q), unit(k)
    s0 = np.random.default_rng(1).standard_normal((2, H, K, V))
    o, s = fn(*(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)), initial_state=jnp.asarray(s0, jnp.float32),
              output_final_state=True, impl=impl)
    for b in range(2):
        ref_o, ref_s = np_kda(q[b], k[b], v[b], g[b], beta[b], K ** -0.5, s0[b])
        np.testing.assert_allclose(o[b], ref_o, **FP32)
        np.testing.assert_allclose(s[b], ref_s, **FP32)


@pytest.mark.parametrize("gate_scale", [30.0, 0.01])  # very strong decay (Kimi Linear's unbounded gate), nearly none
def test_chunked_with_l2norm_scale_and_extreme_gates(gate_scale):
    q, k, v, g, beta = make(100, seed=3, gate_scale=gate_scale)
    o, s = jax.jit(lambda *a: chunk_kda(*a, scale=0.3, output_final_state=True, use_qk_l2norm_in_kernel=True))(
        *(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)))
    ref_o, ref_s = np_kda(q[0], k[0], v[0], g[0], beta[0], 0.3, l2norm=True)
    np.testing.assert_allclose(o[0], ref_o, **FP32)
    np.testing.assert_allclose(s[0], ref_s, **FP32)


def test_bf16_inputs():
    q, k, v, g, beta = make(70, seed=4)
    q, k = unit(q), unit(k)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)] + [jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32)]
    o, _ = chunk_kda(*args)
    assert o.dtype == jnp.bfloat16
    rounded = [np.asarray(a, np.float64) for a in args]  # the reference sees the same rounded inputs
    ref_o, _ = np_kda(*(a[0] for a in rounded), K ** -0.5)
    # fp32 compute; only the output rounding to bf16 (8 mantissa bits, rel 2**-8) remains
    np.testing.assert_allclose(np.asarray(o[0], np.float64), ref_o, rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_packed_sequences_equal_running_each_alone(fn):
    lengths = [1, 64, 70, 0, 3]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v, g, beta = make(int(cu[-1]), seed=5)
    q, k = unit(q), unit(k)
    s0 = np.random.default_rng(6).standard_normal((len(lengths), H, K, V))
    o, s = jax.jit(lambda *a: fn(*a[:5], initial_state=a[5], cu_seqlens=a[6], output_final_state=True))(
        *(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, s0)), jnp.asarray(cu))
    for n in range(len(lengths)):
        part = slice(cu[n], cu[n + 1])
        ref_o, ref_s = np_kda(q[0, part], k[0, part], v[0, part], g[0, part], beta[0, part], K ** -0.5, s0[n])
        np.testing.assert_allclose(o[0, part], ref_o, **FP32)
        np.testing.assert_allclose(s[n], ref_s, **FP32)


def test_bad_arguments_name_the_argument():
    q, k, v, g, beta = (jnp.asarray(a, jnp.float32) for a in make(4, b=2))
    with pytest.raises(ValueError, match="^k has shape"):
        chunk_kda(q, k[:, :3], v, g, beta)
    with pytest.raises(ValueError, match="^v has shape"):
        chunk_kda(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match="cu_seqlens needs a batch of 1"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=jnp.asarray([0, 4]))
    with pytest.raises(ValueError, match="initial_state has shape"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=jnp.zeros((1, H, K, V)))
    with pytest.raises(ValueError, match="unknown impl 'triton'"):
        chunk_kda(q, k, v, g, beta, impl="triton")
