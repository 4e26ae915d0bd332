"""Meshes, the logical-axis table, expert-parallel MoE and sharded forwards on 16 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import K3Config
from k3jax.layers.ffn import gated_activation
from k3jax.model import K3Model
from pallas_kernels.moe import Mxfp4Tensor, expert_ffn, moe_ffn
from sharding.axes import LOGICAL_AXES, partition_spec
from sharding.expert_parallel import expert_parallel_moe
from sharding.mesh import make_mesh, parse_mesh
from tests.agreement import Referee

pytestmark = pytest.mark.skipif(len(jax.devices()) < 16, reason="needs the 16 fake CPU devices of tests/conftest.py")


@pytest.mark.isa_invariant
def test_mesh_strings_and_errors():
    assert parse_mesh("8x2") == {"model": 8, "data": 2} == parse_mesh("model=8, data=2")
    mesh = make_mesh("8x2")
    assert dict(mesh.shape) == {"data": 2, "model": 8}
    # model is the fast axis: consecutive devices form a model-parallel group
    assert [d.id for d in mesh.devices[0]] == list(range(8))
    with pytest.raises(ValueError, match="mesh 8x4 needs 32 devices, found 16"):
        make_mesh("8x4")
    with pytest.raises(ValueError, match="is not 'AxB'"):
        parse_mesh("8by2")


@pytest.mark.isa_invariant
def test_indivisible_meshes_are_named():
    cfg = K3Config.from_preset("k3-tiny")
    with pytest.raises(ValueError, match="8 KDA heads do not divide over model=3"):
        K3Model.random(cfg, mesh=make_mesh("3x5"))
    with pytest.raises(ValueError, match="dimension 'vocab' of size 510 does not divide over model=4"):
        partition_spec(("vocab", "embed"), (510, 64), make_mesh("4x4"))


@pytest.fixture(scope="module")
def reference():
    return K3Model.random(K3Config.from_preset("k3-tiny"), dtype="float32", seed=0)


@pytest.mark.isa_invariant
def test_every_parameter_follows_the_table(reference):
    model = K3Model.random(reference.config, dtype="float32", seed=0, mesh="8x2")
    mesh = model.mesh
    for path, v in nnx.to_flat_state(model.params):
        array = v.get_value()
        expected = tuple(tuple(a for a in LOGICAL_AXES[n] if mesh.shape[a] > 1) for n in v.logical_axes)
        got = tuple((s,) if isinstance(s, str) else tuple(s or ()) for s in array.sharding.spec)
        got = got + ((),) * (array.ndim - len(got))
        assert got == expected, (path, array.sharding.spec, v.logical_axes)
    experts = model.params["layers"][1]["block_sparse_moe"]["experts"]["w1"]["packed"][...]
    assert experts.sharding.spec[0] == ("data", "model")  # 16 experts: one per device
    assert experts.addressable_shards[0].data.shape[0] == 1


@pytest.fixture(scope="module")
def referee(reference):
    return Referee(reference)


def greedy(model, prompt, steps=32, feed=None):
    """Prefill + `steps` decode steps: (tokens [B, steps], their logits [B, steps, V]); the greedy
    tokens, or `feed`'s (teacher forcing)."""
    logits, cache = model.prefill(prompt, max_len=prompt.shape[1] + steps)
    rows = [np.asarray(logits)[:, -1]]
    tokens = []
    for i in range(steps):
        tokens.append(rows[-1].argmax(-1) if feed is None else feed[:, i])
        if i + 1 < steps:
            step, cache = model.decode(tokens[-1], cache)
            rows.append(np.asarray(step))
    return np.stack(tokens, 1), np.stack(rows, 1)


# make test's AVX2 pass runs the serving mesh (8x2) alone: the other shapes split the same paths another way
@pytest.mark.parametrize("mesh", ["8x2", pytest.param("2x8", marks=pytest.mark.isa_covered),
                                  pytest.param("4x4", marks=pytest.mark.isa_covered)])
def test_sharded_logits_and_greedy_decode_match_one_device(referee, mesh):
    """fp32 on a mesh: TP/EP change only the order of partial sums. The full forward's logits, and 32
    greedy tokens (prefill + decode) with their logits, are the one-device reference's within fp32's
    tolerance (tests/agreement.py: teacher-forced, under the router choices that explain the run;
    measured differences stay below 6e-5 of the largest logit)."""
    model = K3Model.random(referee.model.config, dtype="float32", seed=0, mesh=mesh)
    ids = np.random.default_rng(1).integers(0, 512, (8, 10), dtype=np.int32)
    got = model.logits(ids)
    for row, logits in zip(ids, got):
        referee.check_logits(row, logits, what=f"{mesh} full forward")
    prompt = np.random.default_rng(0).integers(0, 512, (8, 6), dtype=np.int32)
    tokens, logits = greedy(model, prompt)
    referee.check_all(prompt, tokens, what=f"{mesh} greedy row")
    for row, out, steps in zip(prompt, tokens, logits):
        referee.check_logits(list(row) + list(out[:-1]), steps, positions=np.arange(5, 5 + len(out)),
                             what=f"{mesh} decode")


def test_bf16_teacher_forced_logits_agree_on_a_mesh():
    """bf16 on the 8x2 mesh against bf16 on one device, fed the same tokens (the one device's greedy
    ones). One mesh: the fp32 test above checks each mesh's sharding; this one, bf16's paths on it.

    Greedy runs are not compared (issue 19): bf16 rounds at 2^-9 and ten random layers amplify rounding
    ~2^10 at a single logit (fp32 paths differ by up to 1e-4 of the largest), so bf16 paths part at
    their first near-tie, router or logit (measured: 11 to 46 of 256 greedy tokens differ); the fp32
    test above checks greedy identity across meshes. In the norm rounding is amplified ~2^8 (fp32
    meshes: 1.2-2e-5 of the logits' norm), so bf16 meshes stay within 2^-9 x 2^8 = 2^-1 of it, router
    flips included (measured 0.05 to 0.15). A smoke check at bf16's resolution: a mesh that loses or
    misplaces a shard's part is off by ~1 (sqrt 2 for unrelated logits)."""
    cfg = K3Config.from_preset("k3-tiny")
    prompt = np.random.default_rng(0).integers(0, 512, (8, 6), dtype=np.int32)
    tokens, want = greedy(K3Model.random(cfg, dtype="bfloat16", seed=0), prompt)
    assert want.dtype == np.float32 and len(np.unique(tokens)) > 32
    _, got = greedy(K3Model.random(cfg, dtype="bfloat16", seed=0, mesh="8x2"), prompt, feed=tokens)
    assert np.linalg.norm(got - want) <= 2.0 ** -1 * np.linalg.norm(want)


def _experts(cfg, seed):
    rng = np.random.default_rng(seed)
    e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_input_size

    def one(out, inp):
        return Mxfp4Tensor(jnp.asarray(rng.integers(0, 256, (e, out, inp // 2)), jnp.uint8),
                           jnp.asarray(rng.integers(121, 124, (e, out, inp // 32)), jnp.uint8))

    return one(f, d), one(f, d), one(d, f)


@pytest.mark.parametrize("everyone_to_device", [None, 5])
def test_expert_parallel_moe_equals_single_device(everyone_to_device):
    cfg = K3Config.from_preset("k3-tiny")
    act = gated_activation(cfg)
    weights = _experts(cfg, 0)
    rng = np.random.default_rng(2)
    t, k = 32, cfg.num_experts_per_token
    x = jnp.asarray(rng.standard_normal((t, cfg.moe_input_size)), jnp.float32)
    if everyone_to_device is None:
        ids = np.stack([rng.choice(cfg.num_experts, k, replace=False) for _ in range(t)])
    else:  # every token's experts live on one device (16 experts over 16 devices: expert == device)
        ids = np.full((t, k), everyone_to_device)
    ids = jnp.asarray(ids, jnp.int32)
    w = jnp.asarray(rng.uniform(0, 1, (t, k)), jnp.float32)
    want = moe_ffn(x, ids, w, *weights, activation=act)
    mesh = make_mesh("8x2")
    ffn = lambda rows, sizes, *ws: expert_ffn(rows, sizes, *ws, activation=act)  # noqa: E731
    got = jax.jit(lambda *a: expert_parallel_moe(ffn, *a[:3], a[3:], mesh=mesh))(x, ids, w, *weights)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.isa_covered  # the 8x2 case of test_sharded_logits_and_greedy_decode_match_one_device
def test_a_batch_data_does_not_divide_is_padded(referee):
    """On a 8x2 mesh, 3 sequences: the model pads the batch to 8 rows and returns only the real ones
    (a notebook user's batch), with the one-device reference's logits and greedy tokens."""
    rows = 3
    model = K3Model.random(referee.model.config, dtype="float32", seed=0, mesh="8x2")
    ids = np.random.default_rng(2).integers(0, 512, (rows, 7), dtype=np.int32)
    got = model.logits(ids)
    assert got.shape[0] == rows
    for row, logits in zip(ids, got):
        referee.check_logits(row, logits, what=f"{rows} rows on 8x2, full forward")
    scores = model.token_logprobs(ids, num_top=2)
    assert scores.chosen.shape == (rows, 6)
    tokens, logits = greedy(model, ids, steps=12)
    assert tokens.shape == (rows, 12)
    # a dozen tokens a row of a random model: near-ties (not asserted) are a larger share than in 8 x 32
    referee.check_all(ids, tokens, what=f"{rows} rows on 8x2, greedy", min_checked=0.7)
