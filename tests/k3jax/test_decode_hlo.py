"""The compiled decode step reads every weight in place: no buffer it materialises is larger than
one expert's weight matrix (issue: stacked layer weights sliced into copies on every step).

The configs are wide enough that every dense weight and every layer's expert pool is larger than
one expert's matrix, while the step's activations and the caches it gathers (one token for one or
two rows, short contexts) are smaller, so any copy of a weight shows up as a buffer over the bound.
fp32: XLA:CPU has no bf16 dot and upcasts bf16 weights into f32 copies, a property of that backend,
not of the model.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import K3Config
from k3jax.hlo import materialised_buffers
from k3jax.decoder import init_pools
from k3jax.model import K3Model, _extend
from k3jax.placement import split_routed_experts
from serve.runner import _step
from tests.k3jax.tiny_configs import KIMI_LINEAR_TINY, k3_tiny_dict

WIDE = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128}


def wide_k3() -> K3Config:
    d = k3_tiny_dict()
    d["text_config"].update(WIDE, routed_expert_hidden_size=128)
    return K3Config.from_hf_dict(d)


def wide_kimi_linear() -> K3Config:
    d = copy.deepcopy(KIMI_LINEAR_TINY)
    d.update(WIDE, qk_nope_head_dim=64, v_head_dim=64)
    d["linear_attn_config"].update(num_heads=8, head_dim=32)
    return K3Config.from_hf_dict(d)


def expert_matrix_bytes(cfg: K3Config) -> int:
    """One expert's [F, D] weight in the activation dtype (fp32): the most the XLA expert loop
    dequantizes at a time."""
    return cfg.moe_intermediate_size * cfg.moe_input_size * 4


def over_the_bound(hlo_text: str, cfg: K3Config) -> list:
    return [b for b in materialised_buffers(hlo_text) if b.bytes > expert_matrix_bytes(cfg)]


@pytest.fixture(scope="module", params=[wide_k3, wide_kimi_linear], ids=["k3", "kimi_linear"])
def model(request):
    return K3Model.random(request.param(), dtype="float32", seed=0)


def test_the_bound_is_below_every_layer_weight(model):
    """So a copy of any layer's expert pool or attention weight would exceed it."""
    layer = model.params["layers"][1]
    pool = max(np.asarray(a).nbytes for a in jax.tree.leaves(layer["block_sparse_moe"]["experts"]["w1"]))
    dense = np.asarray(layer["self_attn"]["o_proj"]["kernel"][...]).nbytes
    assert min(pool, dense) > expert_matrix_bytes(model.config)


def test_a_scan_over_stacked_weights_shows_its_copies():
    """The checker itself: scanning a [layers, D, D] stack materialises each layer's slice (the
    pattern this file guards against); reading the same weights as separate arrays does not, and the
    in-place update of a donated cache is not a new buffer."""
    stack, x = jnp.ones((4, 256, 256)), jnp.ones((1, 256))
    scanned = jax.jit(lambda w, x: jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0])
    copies = [b for b in materialised_buffers(scanned.lower(stack, x).compile().as_text()) if b.bytes >= 256 * 256 * 4]
    assert copies and all(b.shape == "f32[256,256]" for b in copies)

    def separate(weights, x, cache):
        for w in weights:
            x = jnp.tanh(x @ w)
        return x, cache.at[3].set(x[0])

    text = jax.jit(separate, donate_argnums=2).lower(list(stack), x, jnp.zeros((1024, 256))).compile().as_text()
    assert max(b.bytes for b in materialised_buffers(text)) < 256 * 4 * 8


def test_cached_decode_step_copies_no_weight(model):
    cache = model.init_cache(1, 64)
    text = _extend.lower(model.structure, model.params, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
                         cache).compile().as_text()
    assert not over_the_bound(text, model.config)


@pytest.mark.parametrize("rows", [1, 2])
def test_engine_decode_step_copies_no_weight(model, rows):
    cfg = model.config
    pools = init_pools(cfg, num_slots=rows + 1, num_pages=4 * rows + 1, page_size=16, dtype=jnp.float32)
    ints = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    text = _step.lower(model.structure, 1, model.params, pools, ints(rows, 1), jnp.ones((rows,), jnp.int32),
                       ints(rows), ints(rows) + 1, ints(rows, 4), None).compile().as_text()
    assert not over_the_bound(text, cfg)


def test_engine_decode_step_copies_no_page_pool(model):
    """Writing the new row and reading the pages must both happen in the donated pool: no buffer the
    size of an MLA layer's page pool (XLA once fused the write into the read of the old pool and
    copied every pool twice per step)."""
    cfg = model.config
    pools = init_pools(cfg, num_slots=2, num_pages=257, page_size=16, dtype=jnp.float32)
    pool_bytes = 257 * 16 * cfg.mla_cache_width * 4
    ints = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    text = _step.lower(model.structure, 1, model.params, pools, ints(1, 1), jnp.ones((1,), jnp.int32),
                       ints(1), ints(1) + 1, ints(1, 4), None).compile().as_text()
    assert not [b for b in materialised_buffers(text) if b.bytes >= pool_bytes]


@pytest.mark.parametrize("rows", [1, 4])
def test_engine_decode_step_copies_no_slot_pool(model, rows):
    """A decode step reads and writes its rows' KDA slots in the donated pools: no buffer the size of
    a layer's conv-window or state pool (at one row XLA once copied every conv pool, twice per KDA
    layer, to keep the slot's read apart from its in-place write)."""
    cfg = model.config
    pools = init_pools(cfg, num_slots=257, num_pages=4 * rows + 1, page_size=16, dtype=jnp.float32)
    slot_pool_bytes = min(a.nbytes for a in jax.tree.leaves(pools) if a.ndim and a.shape[0] == 257)
    ints = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    text = _step.lower(model.structure, 1, model.params, pools, ints(rows, 1), jnp.ones((rows,), jnp.int32),
                       ints(rows), ints(rows) + 1, ints(rows, 4), None).compile().as_text()
    assert not [b for b in materialised_buffers(text) if b.bytes >= slot_pool_bytes]


def test_split_experts_decode_step_copies_no_expert():
    """With one buffer per expert (K3Model's CPU layout of large experts) the decode step
    materialises nothing the size of an expert's matrix; the stacked layout copies each expert it
    uses out of the stack, so this check can fail."""
    model = K3Model.random(wide_kimi_linear(), dtype="float32", seed=0)  # plain fp32 experts, below the threshold

    def expert_sized(params):
        text = _extend.lower(model.structure, params, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
                             model.init_cache(1, 64)).compile().as_text()
        return [b for b in materialised_buffers(text) if b.bytes >= expert_matrix_bytes(model.config)]

    assert expert_sized(model.params)
    assert not expert_sized(split_routed_experts(model.params, min_bytes=0))
