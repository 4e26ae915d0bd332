"""Routed-expert FFN ops (ARCHITECTURE.md, "Kernels" and "MXFP4").

Expert weights are [E, out, in] in the checkpoint's orientation, each either an `Mxfp4Tensor` (K3)
or a plain array (Kimi Linear): w_gate and w_up [E, F, D], w_down [E, D, F]; or `SplitExperts` of
those (one buffer per expert, the CPU layout: XLA only), the gate and up weights possibly split
together (`split_gate_up`: w_gate holds both, w_up is its placeholder). Matmuls accumulate in
fp32 on weights decoded to the activation dtype; the activation runs in fp32 and is cast to the
activation dtype before the down projection (ARCHITECTURE.md, "MoE and LatentMoE").

impl: "auto" (Pallas on GPU, XLA elsewhere), "pallas" (the Pallas-Triton kernels; interpreted off
a GPU), "xla", "reference". `**tuning`: keyword arguments of the Pallas kernels (column block, warps,
stages: pallas_triton.expert_ffn, which holds the defaults); the other implementations take none
and ignore them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.activations import GatedActivation
from pallas_kernels.moe import pallas_triton, reference, xla
from pallas_kernels.moe.split_experts import SplitExperts, stacked

def expert_ffn(x_sorted, group_sizes, w_gate, w_up, w_down, *, activation: GatedActivation, impl: str = "auto",
               **tuning):
    """Grouped gated FFN over rows already sorted by expert.

    x_sorted [M, D] (bf16 or f32); group_sizes int32 [E]: the rows of expert e are contiguous, in
    expert order, sum(group_sizes) <= M, and rows past the sum are padding that come out as zeros.
    Returns [M, D] in x_sorted's dtype.
    """
    _check_weights(x_sorted, w_gate, w_up, w_down)
    if tuple(group_sizes.shape) != (w_gate.shape[0],):
        raise ValueError(f"group_sizes has shape {tuple(group_sizes.shape)}; expected ({w_gate.shape[0]},), "
                         "one size per expert")
    if x_sorted.shape[0] == 0:  # static; the implementations assume at least one row
        return jnp.zeros_like(x_sorted)
    return _implementation(impl, "expert_ffn", tuning, w_gate)(x_sorted, group_sizes, w_gate, w_up, w_down,
                                                                activation=activation)


def moe_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, activation: GatedActivation, impl: str = "auto",
            **tuning):
    """Routed experts of tokens x [T, D] with topk_ids int32 [T, k] (in [0, E)) and topk_weights [T, k]:
    out[t] = sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t]), each expert output in x's dtype and
    the weighted sum in fp32. Returns float32 [T, D]; the caller applies the latent norm or casts.
    """
    _check_weights(x, w_gate, w_up, w_down)
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0] or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [T={x.shape[0]}, k]")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise ValueError(f"topk_ids must be integer expert ids, got {topk_ids.dtype}")
    if x.shape[0] == 0 or topk_ids.shape[1] == 0:  # static; the implementations assume some rows
        return jnp.zeros(x.shape, jnp.float32)
    return _implementation(impl, "moe_ffn", tuning, w_gate)(x, topk_ids, topk_weights, w_gate, w_up, w_down,
                                                             activation=activation)


def wants_split_experts() -> bool:
    """Whether a model without a mesh should hold its routed experts as SplitExperts: where "auto"
    runs the XLA expert loop (CPU), whose dots then read each expert in place."""
    return jax.default_backend() == "cpu" and dispatch.resolve("auto", True, "") == "xla"


def _implementation(impl: str, op: str, tuning: dict, w_gate):
    """Under a mesh the routed experts already run inside sharding.expert_parallel's shard_map, so
    the kernel needs no wrapping of its own."""
    split = isinstance(w_gate, SplitExperts)
    impl = dispatch.resolve(impl, not split, "SplitExperts weights (one buffer per expert)")
    if impl == "pallas":
        return functools.partial(getattr(pallas_triton, op), interpret=not dispatch.on_gpu(), **tuning)
    if impl == "reference":
        return lambda *args, activation: getattr(reference, op)(*args[:-3], *stacked(*args[-3:]),
                                                                activation=activation)
    return getattr(xla, op)


def _check_weights(x, w_gate, w_up, w_down):
    if len(w_gate.shape) != 3:
        raise ValueError(f"w_gate has shape {tuple(w_gate.shape)}; expected [E, F, D] (experts, out, in)")
    e, f, d = w_gate.shape
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [rows, {d}] to match w_gate {tuple(w_gate.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be floating point (bf16 or f32), got {x.dtype}")
    fused = isinstance(w_gate, SplitExperts) and w_gate.gate_up
    if fused != (isinstance(w_up, SplitExperts) and w_up.is_placeholder):
        raise ValueError("gate and up weights split together (split_gate_up) go as the fused gate weight and the "
                         "placeholder up weight, both or neither")
    if (not fused and tuple(w_up.shape) != (e, f, d)) or tuple(w_down.shape) != (e, d, f):
        raise ValueError(f"expert weights disagree: w_gate {tuple(w_gate.shape)}, w_up {_shape(w_up)}, "
                         f"w_down {tuple(w_down.shape)}; expected [E, F, D], [E, F, D] and [E, D, F]")


def _shape(w):
    return "(split together with w_gate)" if isinstance(w, SplitExperts) and w.is_placeholder else tuple(w.shape)
