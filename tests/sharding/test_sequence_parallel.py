"""Sequence-parallel prefill on 16 fake CPU devices: the KDA state pass against the float64 NumPy
token loop, and `K3Model.prefill_sequence_parallel` against the unsplit prefill on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax.layers.kda import KDACache
from k3jax.model import K3Model
from pallas_kernels.kda import chunk_kda_sequence_parallel
from pallas_kernels.kda import sequence_parallel as kda_sequence_parallel
from sharding.mesh import DATA, make_mesh
from tests.k3jax.tiny_configs import k3_tiny
from tests.pallas_kernels.test_kda import FP32_REL, H, K, V, assert_close, inputs, numpy_kda

pytestmark = pytest.mark.skipif(len(jax.devices()) < 16, reason="needs the 16 fake CPU devices of tests/conftest.py")

# 296 real tokens padded to 320, as the model pads a prompt to equal shards: 2 shards of 160 tokens
# (3 chunks, the second shard 136 real), 4 of 80 (2 chunks, the last 56 real), 8 of 40 (1 chunk,
# the last 16 real); the unsplit run has 5 chunks.
REAL, PADDED = 296, 320


def _split_kda(shards: int):
    """The op under shard_map on a `data` axis of `shards` devices: [B, PADDED, ...] inputs split by
    position, the initial state whole."""
    mesh = make_mesh(f"1x{shards}")
    split = P(None, DATA)

    def body(q, k, v, g, beta, state):
        return chunk_kda_sequence_parallel(q, k, v, g, beta, axis=DATA, initial_state=state, scale=K ** -0.5)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(split,) * 5 + (P(),), out_specs=(split, P()),
                                 check_vma=False))


def _padded_inputs():
    """Random q, k, v, g, beta over REAL tokens, then PADDED - REAL tokens of padding (g = beta = 0: no
    decay, no write; q, k, v random, which must not matter), and a random initial state."""
    q, k, v, g, beta = inputs(PADDED, seed=3)
    g[:, REAL:], beta[:, REAL:] = 0.0, 0.0
    state = np.random.default_rng(4).standard_normal((q.shape[0], H, K, V))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_state_pass_matches_the_token_loop(shards):
    """Every shard's outputs, and the final state, equal the float64 token loop over the whole
    sequence from the initial state: each shard starts from the state the shards before it leave."""
    q, k, v, g, beta, state = _padded_inputs()
    o, final = _split_kda(shards)(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, state)))
    for row in range(q.shape[0]):
        want_o, want_state = numpy_kda(q[row, :REAL], k[row, :REAL], v[row, :REAL], g[row, :REAL],
                                       beta[row, :REAL], K ** -0.5, state[row])
        assert_close(o[row, :REAL], want_o, FP32_REL)
        assert_close(final[row], want_state, FP32_REL)


def test_state_pass_runs_the_pallas_kernel_in_each_shard():
    """impl="pallas" (interpreted off a GPU) inside the shard_map: the kernel runs on each shard's
    span as it is (no nested per-shard dispatch) and gives the token loop's outputs and state. K = V,
    as in the model, so the widened run's 2K suits the kernel."""
    rng = np.random.default_rng(6)
    q, k, _, g, beta = inputs(128, seed=6)
    v = rng.standard_normal((*q.shape[:3], K))
    state = rng.standard_normal((q.shape[0], H, K, K))
    mesh = make_mesh("1x2")

    def body(q, k, v, g, beta, state):
        return chunk_kda_sequence_parallel(q, k, v, g, beta, axis=DATA, initial_state=state, impl="pallas")

    split = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, DATA),) * 5 + (P(),),
                                  out_specs=(P(None, DATA), P()), check_vma=False))
    o, final = split(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, state)))
    want_o, want_state = numpy_kda(q[0], k[0], v[0], g[0], beta[0], K ** -0.5, state[0])
    assert_close(o[0], want_o, FP32_REL)
    assert_close(final[0], want_state, FP32_REL)


def test_zeroing_the_passed_state_fails(monkeypatch):
    """The check above can fail: with every shard past the first starting from zeros instead of the
    state passed to it (the final state still right), its outputs are off by far more than the
    tolerance, while the first shard's stay right."""
    def zeroed(transition, contribution, initial_state, axis):
        _, final = incoming_states(transition, contribution, initial_state, axis)
        return jnp.where(jax.lax.axis_index(axis) == 0, initial_state, 0.0), final

    incoming_states = kda_sequence_parallel.incoming_states
    monkeypatch.setattr(kda_sequence_parallel, "incoming_states", zeroed)
    q, k, v, g, beta, state = _padded_inputs()
    o, _ = _split_kda(4)(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, state)))
    want_o, _ = numpy_kda(q[0, :REAL], k[0, :REAL], v[0, :REAL], g[0, :REAL], beta[0, :REAL], K ** -0.5, state[0])
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(o[0, :REAL], want_o, FP32_REL)
    assert_close(o[0, :PADDED // 4], want_o[:PADDED // 4], FP32_REL)  # the first shard's own start is right


# Two prompts, right-padded: 300 tokens (8 shards of 38 after padding to 304) and 261.
LENGTHS = np.array([300, 261], np.int32)
STEPS = 3  # decode steps after the prefill
# fp32: the split changes only the order of sums (the KDA chunks start at shard boundaries, the
# model's partial sums are split as on any mesh). Measured: logits, caches and decode logits within
# 5e-5 of their largest value (the plain prefill on a mesh: ~3e-5).
REL = 2e-4


def _relative(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.fixture(scope="module")
def plain():
    """The unsplit prefill and STEPS teacher-forced decode steps on one device: (prompt, fed tokens,
    prefill logits, cache, decode logits [STEPS, B, V])."""
    model = K3Model.random(k3_tiny(), dtype="float32", seed=0).with_fixed_routing()
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 512, (len(LENGTHS), LENGTHS.max()), dtype=np.int32)
    fed = rng.integers(0, 512, (STEPS, len(LENGTHS)), dtype=np.int32)
    logits, cache = model.prefill(prompt, LENGTHS, max_len=LENGTHS.max() + STEPS)
    kept = jax.tree.map(np.asarray, cache)  # decoding donates the cache
    return prompt, fed, np.asarray(logits), kept, _decode(model, cache, fed)


def _decode(model, cache, fed):
    steps = []
    for tokens in fed:
        logits, cache = model.decode(tokens, cache)
        steps.append(np.asarray(logits))
    return np.stack(steps)


@pytest.mark.parametrize("mesh", ["8x2", "4x4", "2x8"])
def test_split_prefill_gives_the_plain_prefill_and_decode(plain, mesh):
    """Split over 2, 4 and 8 sequence shards (heads over 8, 4 and 2 devices), the logits of every real
    position, every layer's cache (KDA state and conv window, MLA rows of the real positions) and the
    logits of decoding from that cache are the one-device unsplit run's."""
    prompt, fed, want_logits, want_cache, want_steps = plain
    model = K3Model.random(k3_tiny(), dtype="float32", seed=0, mesh=mesh).with_fixed_routing()
    logits, cache = model.prefill_sequence_parallel(prompt, LENGTHS, max_len=LENGTHS.max() + STEPS)
    rows = len(LENGTHS)
    for row, length in enumerate(LENGTHS):
        assert _relative(logits[row, :length], want_logits[row, :length]) <= REL, (mesh, row)
    np.testing.assert_array_equal(np.asarray(cache.lengths)[:rows], LENGTHS)
    for layer, (got, want) in enumerate(zip(cache.layers, want_cache.layers)):
        if isinstance(want, KDACache):
            assert _relative(got.state[:rows], want.state) <= REL, (mesh, layer, "state")
            assert _relative(got.conv[:rows], want.conv) <= REL, (mesh, layer, "conv")
        else:
            for row, length in enumerate(LENGTHS):
                assert _relative(got.latent[row, :length], want.latent[row, :length]) <= REL, (mesh, layer, row)
    steps = _decode(model, cache, fed)
    assert _relative(steps, want_steps) <= REL, mesh


def test_last_only_gives_each_prompts_last_logits(plain):
    """What the engine asks for (serve/sequence_parallel_prefill.py): the logits of each prompt's last
    real token only, [B, vocab], the unsplit run's at those positions."""
    prompt, _, want_logits, _, _ = plain
    model = K3Model.random(k3_tiny(), dtype="float32", seed=0, mesh="4x4").with_fixed_routing()
    logits, _ = model.prefill_sequence_parallel(prompt, LENGTHS, last_only=True)
    assert logits.shape == (len(LENGTHS), want_logits.shape[-1])
    assert _relative(logits, want_logits[np.arange(len(LENGTHS)), LENGTHS - 1]) <= REL


def test_refusals():
    model = K3Model.random(k3_tiny(), dtype="float32", seed=0)
    with pytest.raises(ValueError, match="has no mesh"):
        model.prefill_sequence_parallel(np.zeros((1, 64), np.int32))
    model = K3Model.random(k3_tiny(), dtype="float32", seed=0, mesh="2x8")
    with pytest.raises(ValueError, match="16-token prompt over 8 sequence shards leaves 2 tokens a shard; "
                                         "the KDA conv window needs at least 3"):
        model.prefill_sequence_parallel(np.zeros((1, 16), np.int32))
