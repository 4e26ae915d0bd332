"""Feed-forward sub-layers: the dense gated MLP (SiTU or SiLU) and the MoE block with LatentMoE
(ARCHITECTURE.md, "MoE and LatentMoE")."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.layers.common import Linear, RMSNorm, param, transposed
from pallas_kernels import moe as moe_ops
from pallas_kernels.activations import GatedActivation
from pallas_kernels.linear import linear
from pallas_kernels.moe import Mxfp4Tensor, SplitExperts
from pallas_kernels.moe import xla as moe_xla
from pallas_kernels.mxfp4_format import GROUP, random_scale_byte
from sharding.expert_parallel import context_mesh, expert_parallel_moe


# Training (k3jax.train) needs gradients through the routed experts, but XLA:CPU's default grouped
# matmul (pallas_kernels.moe.xla's "loop") runs fori_loops with data-dependent trip counts, which JAX
# cannot reverse-differentiate; its "dense" strategy (every token through every expert, gated) can,
# and for the small pools trained here is the fastest on CPU. The list `training_moe` sets collects
# each MoE layer's expert load (tokens per expert) for the router's bias update.
_TRAINING: contextvars.ContextVar[list | None] = contextvars.ContextVar("k3jax_training_moe", default=None)


@contextlib.contextmanager
def training_moe():
    """While tracing inside this context the routed experts run differentiably (every token through
    every expert, weighed by its gates: pallas_kernels.moe.xla's "dense"), and every MoE layer
    appends its expert load int32 [E] to the yielded list (tracers: return them from the traced
    function)."""
    loads: list = []
    token = _TRAINING.set(loads)
    try:
        yield loads
    finally:
        _TRAINING.reset(token)


def gated_activation(cfg: K3Config) -> GatedActivation:
    if cfg.hidden_act == "silu":
        return GatedActivation("silu", None, None)
    # vLLM's dense and shared MLPs fall back to beta 1.0 when the key is absent (the routed path
    # requires it; K3Config validates that).
    return GatedActivation("situ", cfg.activation_situ_beta or 1.0, cfg.activation_situ_linear_beta)


class GatedMLP(nnx.Module):
    """down(act(gate(x), up(x))): the dense layer-0 MLP and the shared experts."""

    def __init__(self, cfg: K3Config, width: int, *, dtype, rngs):
        h = cfg.hidden_size
        self.activation = gated_activation(cfg)
        self.gate_proj = Linear(h, width, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, width, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(width, h, ("mlp", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x):
        hidden = self.activation(self.gate_proj(x), self.up_proj(x)).astype(x.dtype)
        return self.down_proj(hidden)


class RoutedExperts(nnx.Module):
    """Expert weights stacked [E, out, in] in the checkpoint's orientation: MXFP4 packs along `in`.

    K3's experts stay MXFP4 (packed codes + E8M0 scales, decoded inside the expert matmul); Kimi
    Linear's are plain arrays.
    """

    def __init__(self, cfg: K3Config, *, dtype, rngs):
        e, f, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_input_size
        self.w1 = nnx.data(_expert_weight(cfg, (e, f, d), ("experts", "expert_mlp", "expert_embed"), dtype, rngs))
        self.w3 = nnx.data(_expert_weight(cfg, (e, f, d), ("experts", "expert_mlp", "expert_embed"), dtype, rngs))
        self.w2 = nnx.data(_expert_weight(cfg, (e, d, f), ("experts", "expert_embed", "expert_mlp"), dtype, rngs))

    def __call__(self, x, topk_ids, topk_weights, activation):
        weights = (_value(self.w1), _value(self.w3), _value(self.w2))
        mesh = context_mesh()
        if mesh is None and _TRAINING.get() is not None:
            return moe_xla.moe_ffn(x, topk_ids, topk_weights, *weights, activation=activation, strategy="dense")
        if mesh is None:
            return moe_ops.moe_ffn(x, topk_ids, topk_weights, *weights, activation=activation)

        def grouped_ffn(rows, sizes, w1, w3, w2):
            return moe_ops.expert_ffn(rows, sizes, w1, w3, w2, activation=activation)

        return expert_parallel_moe(grouped_ffn, x, topk_ids, topk_weights, weights, mesh=mesh)


def _expert_weight(cfg, shape, axes, dtype, rngs):
    e, out, inp = shape
    if not cfg.experts_mxfp4:
        return param(rngs, shape, axes, dtype, stddev=inp ** -0.5)
    if rngs is None:
        codes = jnp.zeros((e, out, inp // 2), jnp.uint8)
        scales = jnp.full((e, out, inp // GROUP), 127, jnp.uint8)
    else:  # random codes with a power-of-two scale giving roughly fan-in-scaled weights
        codes = jax.random.randint(rngs.params(), (e, out, inp // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        scales = jnp.full((e, out, inp // GROUP), random_scale_byte(inp), jnp.uint8)
    return Mxfp4Tensor(nnx.Param(codes, logical_axes=axes), nnx.Param(scales, logical_axes=axes))


def _value(w):
    """The weight for the expert op: an array, an Mxfp4Tensor, or SplitExperts of either (K3Model
    splits the stacks on CPU: k3jax.placement.split_routed_experts)."""
    if not isinstance(w, Mxfp4Tensor):
        return w.get_value()
    packed, scales = w.packed.get_value(), w.scales.get_value()
    if isinstance(packed, SplitExperts):
        return SplitExperts(tuple(map(Mxfp4Tensor, packed.experts, scales.experts)), packed.gate_up)
    return Mxfp4Tensor(packed, scales)


class MoE(nnx.Module):
    """Router, routed experts (in the latent space when LatentMoE is on) and shared experts."""

    def __init__(self, cfg: K3Config, *, dtype, rngs):
        self.cfg = cfg
        self.activation = gated_activation(cfg)
        self.gate = Router(cfg, dtype=dtype, rngs=rngs)
        if cfg.latent_moe:
            lat = cfg.routed_expert_hidden_size
            self.routed_expert_down_proj = Linear(cfg.hidden_size, lat, ("embed", "latent"), dtype=dtype, rngs=rngs)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(lat, cfg.rms_norm_eps, dtype=dtype)
            self.routed_expert_up_proj = Linear(lat, cfg.hidden_size, ("latent", "embed"), dtype=dtype, rngs=rngs)
        self.experts = RoutedExperts(cfg, dtype=dtype, rngs=rngs)
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, cfg.num_shared_experts * cfg.moe_intermediate_size,
                                           dtype=dtype, rngs=rngs)

    def __call__(self, x):
        cfg = self.cfg
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        topk_ids, topk_weights = self.gate(x)
        loads = _TRAINING.get()
        if loads is not None:
            loads.append(jnp.bincount(topk_ids.reshape(-1), length=cfg.num_experts))
        z = self.routed_expert_down_proj(x) if cfg.latent_moe else x
        routed = self.experts(z, topk_ids, topk_weights, self.activation)  # fp32, summed over the top-k
        if cfg.latent_moe:
            # The norm sees the full latent sum (never per-shard partials), then the up projection.
            routed = self.routed_expert_norm(routed, x.dtype) if cfg.latent_moe_use_norm else routed.astype(x.dtype)
            routed = self.routed_expert_up_proj(routed)
        out = routed.astype(x.dtype)
        if cfg.num_shared_experts:
            out = out + self.shared_experts(x)  # shared experts read the un-projected x
        return out.reshape(shape)


class Router(nnx.Module):
    """fp32 sigmoid (or softmax) scores; e_score_correction_bias affects selection only. The kernel is
    [E, H], as stored, like a Linear's."""

    def __init__(self, cfg: K3Config, *, dtype, rngs):
        self.cfg = cfg
        self.kernel = transposed(param(rngs, (cfg.hidden_size, cfg.num_experts), ("embed", "experts_replicated"), dtype))
        self.e_score_correction_bias = param(None, (cfg.num_experts,), ("experts_replicated",), jnp.float32,
                                             init="zeros")

    def __call__(self, x):
        """x [T, H] -> (topk_ids int32 [T, k], topk_weights f32 [T, k])."""
        return route(x, self.kernel[...], self.e_score_correction_bias[...], self.cfg)


def route(x, kernel, bias, cfg: K3Config):
    logits = linear(x.astype(jnp.float32), kernel)
    if cfg.moe_router_activation_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores + bias
    if cfg.use_grouped_topk and cfg.num_expert_group > 1:
        t = x.shape[0]
        grouped = choice.reshape(t, cfg.num_expert_group, -1)
        top2 = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0]
        group_scores = jnp.sum(top2, axis=-1)  # a group scores the sum of its top-2 biased scores
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        kept = jnp.zeros_like(group_scores, bool).at[jnp.arange(t)[:, None], keep].set(True)
        choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(t, -1)
    _, topk_ids = jax.lax.top_k(choice, cfg.num_experts_per_token)  # ties: lower index wins
    weights = jnp.take_along_axis(scores, topk_ids, axis=-1)
    if cfg.moe_renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return topk_ids.astype(jnp.int32), weights * cfg.routed_scaling_factor
