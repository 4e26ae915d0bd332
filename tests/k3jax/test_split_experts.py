"""K3Model's CPU layout of the routed experts (k3jax.placement.split_routed_experts): one buffer per
expert where an expert's matrix reaches the threshold (gate and up together in one), the same
logits as the stacked layout, and the stack given back by pallas_kernels.moe.stacked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.model import K3Model, _logits
from k3jax.placement import split_routed_experts
from pallas_kernels.moe import SPLIT_MIN_BYTES, SplitExperts, stacked
from tests.k3jax.tiny_configs import k3_tiny, kimi_linear_tiny


def routed(params) -> dict:
    """path -> value of every routed-expert array (MXFP4: codes and scales apart)."""
    return {path: v.get_value() for path, v in nnx.to_flat_state(params) if "experts" in path and "shared_experts"
            not in path and path[path.index("experts") + 1] in ("w1", "w2", "w3")}


@pytest.mark.parametrize("config", [k3_tiny, kimi_linear_tiny], ids=["k3_mxfp4", "kimi_linear_plain"])
def test_split_layout_gives_the_stacked_logits(config):
    model = K3Model.random(config(), dtype="float32", seed=0)  # tiny experts: stacked by default
    assert routed(model.params) and not any(isinstance(v, SplitExperts) for v in routed(model.params).values())
    split = split_routed_experts(model.params, min_bytes=0)
    for path, value in routed(split).items():
        assert isinstance(value, SplitExperts), path
        assert value.gate_up == (path[path.index("experts") + 1] in ("w1", "w3")), path
    for layer in {path[:path.index("experts") + 1] for path in routed(split)}:
        names = [p for p in routed(split) if p[:len(layer)] == layer]
        for tail in {p[len(layer) + 1:] for p in names}:  # () for arrays, ("packed",) and ("scales",) for MXFP4
            got = stacked(*(routed(split)[(*layer, w, *tail)] for w in ("w1", "w3", "w2")))
            for w, array in zip(("w1", "w3", "w2"), got):
                np.testing.assert_array_equal(np.asarray(array), np.asarray(routed(model.params)[(*layer, w, *tail)]))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (3, 10)), jnp.int32)
    lengths = jnp.asarray([10, 7, 4], jnp.int32)
    want = np.asarray(_logits(model.structure, model.params, tokens, lengths))
    got = np.asarray(_logits(model.structure, split, tokens, lengths))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_the_threshold_is_one_experts_matrix_as_stored():
    model = K3Model.random(kimi_linear_tiny(), dtype="float32", seed=0)
    size = model.config.moe_intermediate_size * model.config.hidden_size * 4  # fp32 [F, D]
    assert size < SPLIT_MIN_BYTES
    for min_bytes, split in [(size, True), (size + 1, False)]:
        values = routed(split_routed_experts(model.params, min_bytes=min_bytes)).values()
        assert all(isinstance(v, SplitExperts) == split for v in values)


def test_large_experts_are_split_by_default_on_cpu():
    cfg = kimi_linear_tiny()
    model = K3Model.random(cfg.replace(moe_intermediate_size=SPLIT_MIN_BYTES // (4 * cfg.hidden_size)), seed=0)
    assert jax.default_backend() == "cpu" and model.dtype == jnp.float32
    values = routed(model.params).values()
    assert values and all(isinstance(v, SplitExperts) for v in values)
