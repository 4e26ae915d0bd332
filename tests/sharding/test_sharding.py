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

pytestmark = pytest.mark.skipif(len(jax.devices()) < 16, reason="needs the 16 fake CPU devices of tests/conftest.py")


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


def test_indivisible_meshes_are_named():
    cfg = K3Config.from_preset("k3-tiny")
    with pytest.raises(ValueError, match="8 KDA heads do not divide over model=3"):
        K3Model.random(cfg, mesh=make_mesh("3x5"))
    with pytest.raises(ValueError, match="dimension 'vocab' of size 510 does not divide over model=4"):
        partition_spec(("vocab", "embed"), (510, 64), make_mesh("4x4"))


@pytest.fixture(scope="module")
def reference():
    return K3Model.random(K3Config.from_preset("k3-tiny"), dtype="float32", seed=0)


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


@pytest.mark.parametrize("mesh", ["8x2", "2x8", "4x4"])
def test_sharded_logits_and_decode_match_one_device(reference, mesh):
    ids = np.random.default_rng(1).integers(0, 512, (8, 10), dtype=np.int32)
    want = reference.logits(ids)
    model = K3Model.random(reference.config, dtype="float32", seed=0, mesh=mesh)
    # fp32; TP/EP/DP change only the order of partial sums (no router top-k margin of these inputs is
    # below 4.8e-5, far above fp32 rounding of the scores, so no expert choice flips), amplified over
    # 10 random layers: measured 1.2-2.0e-5 relative as a whole (Frobenius) and at most 9.3e-5 of the
    # largest logit on one row (the same on 2x1, where each device runs whole rows)
    got = model.logits(ids)
    assert np.linalg.norm(got - want) <= 5e-5 * np.linalg.norm(want)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * scale)
    _, cache = model.prefill(ids[:, :7], max_len=12)
    for t in range(7, 10):
        step, cache = model.decode(ids[:, t], cache)
        np.testing.assert_allclose(np.asarray(step), want[:, t], rtol=0, atol=2e-4 * scale)


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


def test_bf16_greedy_runs_agree_across_meshes():
    """bf16: 32 greedy tokens for 8 prompts are the same on every mesh as on one device."""
    cfg = K3Config.from_preset("k3-tiny")
    prompt = np.random.default_rng(0).integers(0, 512, (8, 6), dtype=np.int32)

    def greedy(model, steps=32):
        logits, cache = model.prefill(prompt, max_len=prompt.shape[1] + steps)
        token = np.asarray(logits)[:, -1].argmax(-1)
        tokens = [token]
        for _ in range(steps - 1):
            step, cache = model.decode(token, cache)
            token = np.asarray(step).argmax(-1)
            tokens.append(token)
        return np.stack(tokens, 1)

    want = greedy(K3Model.random(cfg, dtype="bfloat16", seed=0))
    for mesh in ("8x2", "2x8", "4x4"):
        np.testing.assert_array_equal(greedy(K3Model.random(cfg, dtype="bfloat16", seed=0, mesh=mesh)), want,
                                      err_msg=mesh)
