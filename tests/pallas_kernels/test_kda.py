"""KDA op: every implementation against a float64 NumPy loop written from the math (not the package)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda, fused_recurrent_kda

B, H, K, V = 2, 2, 32, 16  # K != V so a transposed state cannot pass
T = 130  # the length most tests share (three chunks, the last one partial), so shapes compile once

# fp32 compute: about 1e-7 per operation, summed over <= 130 steps and 32-term products, stays
# near 1e-6 of the largest value; 1e-5 leaves a margin without hiding a real mistake.
FP32_REL = 1e-5


def numpy_kda(q, k, v, g, beta, scale, state=None, l2norm=False):
    """One sequence [T, H, *] in float64, token by token:
    S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    if l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    s = np.zeros((q.shape[1], q.shape[2], v.shape[2])) if state is None else np.array(state, np.float64)
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            s[h] *= np.exp(g[t, h])[:, None]
            s[h] += np.outer(k[t, h], beta[t, h] * (v[t, h] - s[h].T @ k[t, h]))
            out[t, h] = s[h].T @ (scale * q[t, h])
    return out, s


def inputs(t, b=B, seed=0, gate=1.0, unit_qk=True):
    """q, k (unit rows unless unit_qk=False), v, g = -gate * U(0, 1), beta in (0, 1); float64 numpy."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, b, t, H, K))
    if unit_qk:
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.standard_normal((b, t, H, V))
    g = -gate * rng.uniform(0, 1, (b, t, H, K))
    beta = rng.uniform(0, 1, (b, t, H))
    return q, k, v, g, beta


def assert_close(actual, expected, rel):
    """Max error relative to the largest expected value (entries near zero need no own tolerance)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    err = np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30)
    assert err <= rel, f"relative error {err:.2e} > {rel:.0e}"


def f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


IMPLS = [(chunk_kda, "xla"), (fused_recurrent_kda, "xla"), (chunk_kda, "reference")]
IMPL_IDS = ["chunk-xla", "recurrent-xla", "reference"]


@pytest.mark.parametrize("t", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("with_initial_state", [False, True])
@pytest.mark.parametrize(("fn", "impl"), IMPLS, ids=IMPL_IDS)
def test_matches_numpy(fn, impl, t, with_initial_state):
    q, k, v, g, beta = inputs(t, seed=t)
    s0 = np.random.default_rng(1).standard_normal((B, H, K, V)) if with_initial_state else None
    o, s = fn(*f32(q, k, v, g, beta), initial_state=None if s0 is None else f32(s0)[0],
              output_final_state=True, impl=impl)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    for b in range(B):
        ref_o, ref_s = numpy_kda(q[b], k[b], v[b], g[b], beta[b], K ** -0.5, None if s0 is None else s0[b])
        assert_close(o[b], ref_o, FP32_REL)
        assert_close(s[b], ref_s, FP32_REL)


@pytest.mark.parametrize(("fn", "impl"), IMPLS, ids=IMPL_IDS)
def test_l2norm_in_kernel_and_custom_scale(fn, impl):
    q, k, v, g, beta = inputs(T, seed=2, unit_qk=False)
    q, k = 3 * q, 0.5 * k  # the kernel must normalise them
    o, s = fn(*f32(q, k, v, g, beta), scale=0.3, output_final_state=True, use_qk_l2norm_in_kernel=True, impl=impl)
    for b in range(B):
        ref_o, ref_s = numpy_kda(q[b], k[b], v[b], g[b], beta[b], 0.3, l2norm=True)
        assert_close(o[b], ref_o, FP32_REL)
        assert_close(s[b], ref_s, FP32_REL)
    o_plain, no_state = fn(*f32(q, k, v, g, beta), scale=0.3, impl=impl)  # the same inputs, not normalised
    assert no_state is None  # output_final_state=False
    assert np.abs(np.asarray(o_plain) - np.asarray(o)).max() > 1e-2


@pytest.mark.parametrize("gate", [30.0, 200.0, "constant"])
@pytest.mark.parametrize(("fn", "impl"), IMPLS[:2], ids=IMPL_IDS[:2])
def test_very_negative_gates(fn, impl, gate):
    """Kimi Linear's unbounded gate: per-step decays far below exp(-40), where a chunk's
    cumulative decay would overflow fp32 if it were factored as exp(G_i) * exp(-G_j)."""
    q, k, v, g, beta = inputs(T, seed=3, gate=1.0 if gate == "constant" else gate)
    if gate == "constant":
        g = np.full_like(g, -30.0)
    s0 = np.random.default_rng(4).standard_normal((B, H, K, V))
    o, s = fn(*f32(q, k, v, g, beta), initial_state=f32(s0)[0], output_final_state=True, impl=impl)
    assert np.isfinite(np.asarray(o)).all()
    for b in range(B):
        ref_o, ref_s = numpy_kda(q[b], k[b], v[b], g[b], beta[b], K ** -0.5, s0[b])
        assert_close(o[b], ref_o, FP32_REL)
        assert_close(s[b], ref_s, FP32_REL)


def test_k3_gates_fast_path():
    """K3's bounded gate g in (-5, 0): the chunked path's fast score split, near its exponent limit."""
    q, k, v, g, beta = inputs(T, seed=5)
    g = -5.0 / (1.0 + np.exp(-3.0 * np.random.default_rng(6).standard_normal(g.shape)))
    o, s = chunk_kda(*f32(q, k, v, g, beta), output_final_state=True, impl="xla")
    for b in range(B):
        ref_o, ref_s = numpy_kda(q[b], k[b], v[b], g[b], beta[b], K ** -0.5)
        assert_close(o[b], ref_o, FP32_REL)
        assert_close(s[b], ref_s, FP32_REL)


@pytest.mark.parametrize(("fn", "impl"), [*IMPLS[:2], (chunk_kda, "pallas"), (fused_recurrent_kda, "pallas")],
                         ids=[*IMPL_IDS[:2], "chunk-pallas", "recurrent-pallas"])
def test_bf16_inputs(fn, impl):
    q, k, v, g, beta = inputs(T, b=1, seed=7)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, g, beta)]
    o, s = fn(*args, output_final_state=True, impl=impl)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    # The reference sees the same bf16-rounded inputs, so only the computation differs: fp32 inside,
    # then o rounded to bf16 (8 significant bits: at most 2**-9 of |o|). The state stays fp32.
    ref_o, ref_s = numpy_kda(*(np.asarray(x, np.float64)[0] for x in args), K ** -0.5)
    assert_close(o[0], ref_o, 2.0 ** -8)
    assert_close(s[0], ref_s, FP32_REL)


@pytest.mark.parametrize(("fn", "impl"), IMPLS, ids=IMPL_IDS)
def test_packed_sequences_equal_running_each_alone(fn, impl):
    lengths = [1, 64, 0, 70, 3]  # the empty one must keep its initial state
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v, g, beta = inputs(int(cu[-1]), b=1, seed=8)
    s0 = np.random.default_rng(9).standard_normal((len(lengths), H, K, V))
    # cu_seqlens is traced (the op is jitted): the packed layout may only depend on its shape.
    o, s = fn(*f32(q, k, v, g, beta), initial_state=f32(s0)[0], cu_seqlens=jnp.asarray(cu),
              output_final_state=True, impl=impl)
    assert o.shape == (1, cu[-1], H, V) and s.shape == (len(lengths), H, K, V)
    for n in range(len(lengths)):
        part = slice(cu[n], cu[n + 1])
        ref_o, ref_s = numpy_kda(q[0, part], k[0, part], v[0, part], g[0, part], beta[0, part], K ** -0.5, s0[n])
        if lengths[n]:
            assert_close(o[0, part], ref_o, FP32_REL)
        assert_close(s[n], ref_s, FP32_REL)


def test_chunked_and_recurrent_agree_under_jit():
    q, k, v, g, beta = f32(*inputs(T, seed=10, unit_qk=False))
    s0 = jnp.asarray(np.random.default_rng(11).standard_normal((B, H, K, V)), jnp.float32)
    kwargs = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True, impl="xla")
    o_c, s_c = jax.jit(lambda *a: chunk_kda(*a, **kwargs))(q, k, v, g, beta)
    o_r, s_r = jax.jit(lambda *a: fused_recurrent_kda(*a, **kwargs))(q, k, v, g, beta)
    assert_close(o_c, o_r, FP32_REL)
    assert_close(s_c, s_r, FP32_REL)


@pytest.mark.parametrize("packed", [False, True])
def test_auto_prefill_form_on_cpu_follows_the_state_size(packed, monkeypatch):
    """On CPU, chunk_kda's "auto" is the token scan while the states fit api.SCAN_STATE_VALUES and the
    chunked XLA form past it: bit for bit the one or the other, never a mix. States of B x H x K x V
    = 2048 values here; the limit moves to either side of it."""
    from pallas_kernels.kda import api

    q, k, v, g, beta = f32(*inputs(T, seed=12))
    kwargs = dict(output_final_state=True)
    if packed:  # the states are one per packed sequence: two here, as the two rows unpacked
        q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
        kwargs["cu_seqlens"] = jnp.asarray([0, T, 2 * T], jnp.int32)
    scan = fused_recurrent_kda(q, k, v, g, beta, **kwargs)
    chunked = chunk_kda(q, k, v, g, beta, impl="xla", **kwargs)
    assert np.abs(np.asarray(scan[0]) - np.asarray(chunked[0])).max() > 0  # the two forms are told apart
    for limit, expected in ((B * H * K * V, scan), (B * H * K * V - 1, chunked)):
        monkeypatch.setattr(api, "SCAN_STATE_VALUES", limit)
        for got, want in zip(chunk_kda(q, k, v, g, beta, **kwargs), expected):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_bad_arguments_name_the_argument(fn):
    q, k, v, g, beta = f32(*inputs(4))
    for message, call in [
        ("k has shape", lambda: fn(q, k[:, :3], v, g, beta)),
        ("g has shape", lambda: fn(q, k, v, g[..., :8], beta)),
        ("beta has shape", lambda: fn(q, k, v, g, beta[:, :, :1])),
        ("v has shape", lambda: fn(q, k, v[:, :3], g, beta)),
        ("q must be", lambda: fn(q[0], k, v, g, beta)),
        ("cu_seqlens .* B = 1", lambda: fn(q, k, v, g, beta, cu_seqlens=jnp.asarray([0, 2, 4], jnp.int32))),
        ("cu_seqlens must hold integer", lambda: fn(q[:1], k[:1], v[:1], g[:1], beta[:1],
                                                    cu_seqlens=jnp.asarray([0.0, 4.0]))),
        ("initial_state has shape", lambda: fn(q, k, v, g, beta, initial_state=jnp.zeros((1, H, K, V)))),
        ("initial_state has shape", lambda: fn(q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=jnp.zeros(
            (1, H, K, V)), cu_seqlens=jnp.asarray([0, 1, 4], jnp.int32))),
        ("unknown impl 'triton'", lambda: fn(q, k, v, g, beta, impl="triton")),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
