"""Router, LatentMoE block and dense MLP against NumPy versions of ARCHITECTURE.md, "MoE and LatentMoE"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert import mxfp4
from k3jax.layers.ffn import MoE, route
from tests.k3jax.tiny_configs import k3_tiny, kimi_linear_tiny


def np_route(x, kernel, bias, cfg, margins=False):
    """(ids, weights) of the router in float64; with `margins`, also each token's smallest
    decision margin (the k-th against the (k+1)-th kept score, and the kept groups against the next)."""
    scores = 1 / (1 + np.exp(-(x @ kernel)))
    choice = scores + bias
    t, e = choice.shape
    margin = np.full(t, np.inf)
    if cfg.num_expert_group > 1:
        groups = choice.reshape(t, cfg.num_expert_group, -1)
        gscore = np.sort(groups, -1)[..., -2:].sum(-1)
        keep = np.argsort(-gscore, -1, kind="stable")[:, :cfg.topk_group]
        if cfg.topk_group < cfg.num_expert_group:
            ranked = -np.sort(-gscore, -1)
            margin = ranked[:, cfg.topk_group - 1] - ranked[:, cfg.topk_group]
        mask = np.zeros_like(gscore, bool)
        np.put_along_axis(mask, keep, True, -1)
        choice = np.where(mask[..., None], groups, -np.inf).reshape(t, e)
    k = cfg.num_experts_per_token
    ids = np.argsort(-choice, -1, kind="stable")[:, :k]
    ranked = -np.sort(-choice, -1)
    margin = np.minimum(margin, np.where(np.isfinite(ranked[:, k]), ranked[:, k - 1] - ranked[:, k], np.inf))
    w = np.take_along_axis(scores, ids, -1)
    if cfg.moe_renormalize:
        w = w / w.sum(-1, keepdims=True)
    return (ids, w * cfg.routed_scaling_factor) + ((margin,) if margins else ())


@pytest.mark.parametrize("make_cfg", [k3_tiny, kimi_linear_tiny])
def test_router_matches_numpy(make_cfg):
    cfg = make_cfg()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((24, cfg.hidden_size))
    kernel = rng.standard_normal((cfg.hidden_size, cfg.num_experts)) / 8
    bias = rng.standard_normal(cfg.num_experts) * 0.3  # large enough to change the selection
    ids, w = route(jnp.asarray(x, jnp.float32), jnp.asarray(kernel.T, jnp.float32), jnp.asarray(bias, jnp.float32), cfg)
    ref_ids, ref_w, margin = np_route(x, kernel, bias, cfg, margins=True)
    # every decision of these inputs is clear of a tie by far more than fp32 rounding moves a score
    # (~1e-7): the selections must then agree exactly
    assert margin.min() > 1e-5
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(ref_ids, -1))
    order, ref_order = np.argsort(ids, -1), np.argsort(ref_ids, -1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                               np.take_along_axis(ref_w, ref_order, -1), rtol=1e-5)
    plain = np.argsort(-(1 / (1 + np.exp(-(x @ kernel)))), -1)[:, :cfg.num_experts_per_token]
    assert (np.sort(plain, -1) != np.sort(ref_ids, -1)).any()  # the bias did matter


def _situ(g, u, beta, lin):
    return beta * np.tanh(g / beta) / (1 + np.exp(-g)) * lin * np.tanh(u / lin)


def test_latent_moe_block_matches_numpy():
    cfg = k3_tiny()
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    moe.gate.e_score_correction_bias[...] = jnp.asarray(np.random.default_rng(1).standard_normal(cfg.num_experts) * 0.1,
                                                         jnp.float32)
    x = np.random.default_rng(2).standard_normal((5, cfg.hidden_size))
    with jax.default_matmul_precision("highest"):
        out = np.asarray(moe(jnp.asarray(x, jnp.float32)[None]))[0]

    w = lambda lin: np.asarray(lin.kernel[...], np.float64).T  # [in, out]  # noqa: E731
    deq = lambda t: mxfp4.dequantize(np.asarray(t.packed[...]), np.asarray(t.scales[...])).astype(np.float64)  # noqa
    beta, lin, eps = cfg.activation_situ_beta, cfg.activation_situ_linear_beta, cfg.rms_norm_eps
    ids, weights, margin = np_route(x, w(moe.gate), np.asarray(moe.gate.e_score_correction_bias[...]), cfg, margins=True)
    assert margin.min() > 1e-5  # routed alike at any rounding of the "highest" precision forward
    z = x @ w(moe.routed_expert_down_proj)
    w1, w3, w2 = deq(moe.experts.w1), deq(moe.experts.w3), deq(moe.experts.w2)
    r = np.zeros_like(z)
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], weights[t]):
            r[t] += wt * (_situ(w1[e] @ z[t], w3[e] @ z[t], beta, lin) @ w2[e].T)
    r = r / np.sqrt(np.mean(r ** 2, -1, keepdims=True) + eps) * np.asarray(moe.routed_expert_norm.weight[...])
    routed = r @ w(moe.routed_expert_up_proj)
    s = moe.shared_experts
    shared = _situ(x @ w(s.gate_proj), x @ w(s.up_proj), beta, lin) @ w(s.down_proj)
    np.testing.assert_allclose(out, routed + shared, rtol=1e-4, atol=1e-5)
