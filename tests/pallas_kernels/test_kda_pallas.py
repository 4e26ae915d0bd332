"""KDA Pallas-Triton kernels (interpret mode) against a float64 NumPy loop, the packed chunk layout,
and lowering of the kernels to Triton for an H200 and an MI300 at K3's shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import api, chunk_kda, fused_recurrent_kda, layout, pallas_triton
from tests.pallas_kernels.gpu_lowering import lower_for_gpu, triton_call_count
from tests.pallas_kernels.test_kda import assert_close, numpy_kda

H, K, V = 2, 32, 64  # K != V so a transposed state cannot pass; V = 2 state tiles of 32 columns
LENGTHS = [1, 64, 0, 70, 3, 130]  # packed: length 1, a whole chunk, an empty one, ragged ends
T = 130  # batch rows: two chunks and a ragged third

# Interpret mode computes in fp32 (exact fp32 products on CPU): about 1e-7 per operation, summed over
# <= 130 steps and 32-term products, stays near 1e-6 of the largest value; 1e-5 leaves a margin.
FP32_REL = 1e-5

PALLAS = [(chunk_kda, "pallas"), (fused_recurrent_kda, "pallas")]
PALLAS_IDS = ["chunk", "recurrent"]


def make_inputs(lengths_or_shape, seed, gate=1.0, unit_qk=True):
    """q, k (unit rows unless unit_qk=False), v, g = -gate * U(0, 1), beta in (0, 1): float64 [B, T, H, *]."""
    b, t = lengths_or_shape
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, b, t, H, K))
    if unit_qk:
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    return q, k, rng.standard_normal((b, t, H, V)), -gate * rng.uniform(0, 1, (b, t, H, K)), rng.uniform(0, 1, (b, t, H))


def packed(lengths, seed):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    states = np.random.default_rng(seed + 100).standard_normal((len(lengths), H, K, V))
    return cu, states, make_inputs((1, int(cu[-1])), seed)


def f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


# The API's tuning keywords, passed to the kernels: 32-token chunks (two 16-row state steps each) and
# 16-column state tiles, against the defaults (64-token chunks, 32-column tiles).
SMALL_TILES = {chunk_kda: {"chunk_size": 32, "block_v": 16}, fused_recurrent_kda: {"block_v": 16}}


@pytest.mark.parametrize("small_tiles", [False, True], ids=["default_tiles", "small_tiles"])
@pytest.mark.parametrize(("fn", "impl"), PALLAS, ids=PALLAS_IDS)
def test_packed_sequences_with_initial_states(fn, impl, small_tiles):
    cu, s0, (q, k, v, g, beta) = packed(LENGTHS, seed=1)
    o, s = fn(*f32(q, k, v, g, beta), initial_state=f32(s0)[0], cu_seqlens=jnp.asarray(cu),
              output_final_state=True, impl=impl, **(SMALL_TILES[fn] if small_tiles else {}))
    assert o.shape == (1, cu[-1], H, V) and s.shape == (len(LENGTHS), H, K, V)
    for n in range(len(LENGTHS)):
        part = slice(cu[n], cu[n + 1])
        ref_o, ref_s = numpy_kda(q[0, part], k[0, part], v[0, part], g[0, part], beta[0, part], K ** -0.5, s0[n])
        if LENGTHS[n]:
            assert_close(o[0, part], ref_o, FP32_REL)
        assert_close(s[n], ref_s, FP32_REL)  # the empty sequence keeps its initial state


@pytest.mark.parametrize(("fn", "impl"), PALLAS, ids=PALLAS_IDS)
def test_batch_rows_without_initial_state(fn, impl):
    q, k, v, g, beta = make_inputs((2, T), seed=0)
    o, s = fn(*f32(q, k, v, g, beta), output_final_state=True, impl=impl)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    for b in range(2):
        ref_o, ref_s = numpy_kda(q[b], k[b], v[b], g[b], beta[b], K ** -0.5)
        assert_close(o[b], ref_o, FP32_REL)
        assert_close(s[b], ref_s, FP32_REL)


@pytest.mark.parametrize("gate", [30.0, "constant"])
def test_strong_gates_stay_finite_and_exact(gate):
    """Kimi Linear's unbounded gate: decays far below exp(-40) per step. The in-chunk decays must be
    exp of differences <= 0, never exp(G_i) * exp(-G_j), which would overflow fp32."""
    q, k, v, g, beta = make_inputs((2, T), seed=3, gate=1.0 if gate == "constant" else gate)
    if gate == "constant":
        g = np.full_like(g, -30.0)
    o, s = chunk_kda(*f32(q, k, v, g, beta), output_final_state=True, impl="pallas")
    assert np.isfinite(np.asarray(o)).all()
    for b in range(2):
        ref_o, ref_s = numpy_kda(q[b], k[b], v[b], g[b], beta[b], K ** -0.5)
        assert_close(o[b], ref_o, FP32_REL)
        assert_close(s[b], ref_s, FP32_REL)


@pytest.mark.parametrize(("fn", "impl"), PALLAS, ids=PALLAS_IDS)
def test_l2norm_in_kernel_and_custom_scale(fn, impl):
    q, k, v, g, beta = make_inputs((2, T), seed=2, unit_qk=False)
    q, k = 3 * q, 0.5 * k  # the kernel must normalise them
    o, s = fn(*f32(q, k, v, g, beta), scale=0.3, output_final_state=True, use_qk_l2norm_in_kernel=True, impl=impl)
    for b in range(2):
        ref_o, ref_s = numpy_kda(q[b], k[b], v[b], g[b], beta[b], 0.3, l2norm=True)
        assert_close(o[b], ref_o, FP32_REL)
        assert_close(s[b], ref_s, FP32_REL)


def test_chunk_layout_tiles_each_sequence():
    """Chunks cover each sequence in order and hold 1..64 tokens; padded positions follow the chunks."""
    lengths = [1, 64, 0, 70, 3, 130, 200]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t, chunk = int(cu[-1]), 64
    num_chunks = layout.num_chunks_bound(t, len(lengths), chunk) + 3  # spare rows stay unused
    traced = layout.chunk_layout(jnp.asarray(cu), chunk, num_chunks)
    positions = np.asarray(layout.padded_positions(jnp.asarray(cu), t, chunk, traced))
    chunks = layout.ChunkLayout(*map(np.asarray, traced))
    used = set()
    for n, length in enumerate(lengths):
        first, count = chunks.seq_first[n], chunks.seq_chunks[n]
        token = cu[n]
        for c in range(first, first + count):
            end = chunks.start[c] + chunks.length[c]
            assert chunks.start[c] == token and 1 <= chunks.length[c] <= chunk and chunks.seq[c] == n
            assert (chunks.first[c], chunks.last[c]) == (c == first, c == first + count - 1)
            np.testing.assert_array_equal(positions[token:end], c * chunk + np.arange(end - token))
            used.add(c)
            token = end
        assert token == cu[n + 1]
    unused = [c for c in range(num_chunks) if c not in used]
    assert (chunks.length[unused] == 0).all()
    assert not (chunks.first[unused] | chunks.last[unused]).any()


def test_bad_arguments_name_the_argument():
    q, k, v, g, beta = f32(*make_inputs((1, 4), seed=6))
    with pytest.raises(ValueError, match=r"impl='pallas' does not take .*q \(1, 4, 2, 24\)"):
        chunk_kda(q[..., :24], k[..., :24], v, g[..., :24], beta, impl="pallas")
    with pytest.raises(ValueError, match=r"impl='pallas' does not take .*v \(1, 4, 2, 8\)"):
        fused_recurrent_kda(q, k, v[..., :8], g, beta, impl="pallas")


def test_auto_is_xla_off_gpu():
    assert jax.default_backend() != "gpu"  # the CPU test suite
    rows = jnp.zeros((1, 1, 1, 128))
    assert api._resolve("auto", rows, rows) == "xla"


# K3 per device: 12 KDA heads of 128 at TP8, chunks of 64, bf16 activations with fp32 gates; 8192
# tokens packed as two sequences, the first ending mid-chunk.
K3_T, K3_H, K3_D = 8192, 12, 128


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize(("kernel", "calls"), [(pallas_triton.chunk_kda, 2), (pallas_triton.fused_recurrent_kda, 1)],
                         ids=["chunk", "recurrent"])
def test_lowers_to_triton_at_k3_shapes(kernel, calls, platform):
    def run(q, k, v, g, beta, initial_state, cu_seqlens):
        return kernel(q, k, v, g, beta, scale=K3_D ** -0.5, initial_state=initial_state, cu_seqlens=cu_seqlens,
                      l2norm=True)

    rows = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    args = (rows((1, K3_T, K3_H, K3_D)), rows((1, K3_T, K3_H, K3_D)), rows((1, K3_T, K3_H, K3_D)),
            jax.ShapeDtypeStruct((1, K3_T, K3_H, K3_D), jnp.float32), jax.ShapeDtypeStruct((1, K3_T, K3_H), jnp.float32),
            jax.ShapeDtypeStruct((2, K3_H, K3_D, K3_D), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32))
    assert triton_call_count(lower_for_gpu(run, *args, platform=platform)) == calls
