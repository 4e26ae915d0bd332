"""MoE expert FFN in XLA: `lax.ragged_dot` over rows sorted by expert, on weights dequantized to the
activation dtype (the Pallas kernel decodes MXFP4 tiles in registers instead)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe.mxfp4 import Mxfp4Tensor, dequantize


def _dense(w, dtype):
    """[E, out, in] -> [E, in, out] in dtype (ragged_dot's rhs layout)."""
    w = dequantize(w, dtype) if isinstance(w, Mxfp4Tensor) else w.astype(dtype)
    return jnp.swapaxes(w, 1, 2)


def _take(w, experts):
    return Mxfp4Tensor(w.packed[experts], w.scales[experts]) if isinstance(w, Mxfp4Tensor) else w[experts]


def _grouped_ffn(x, group_sizes, w_gate, w_up, w_down, activation):
    """fp32 [M, D]; rows past sum(group_sizes) come out as zeros."""
    gate = jax.lax.ragged_dot(x, _dense(w_gate, x.dtype), group_sizes, preferred_element_type=jnp.float32)
    up = jax.lax.ragged_dot(x, _dense(w_up, x.dtype), group_sizes, preferred_element_type=jnp.float32)
    hidden = activation(gate, up).astype(x.dtype)
    return jax.lax.ragged_dot(hidden, _dense(w_down, x.dtype), group_sizes, preferred_element_type=jnp.float32)


def expert_ffn(x_sorted, group_sizes, w_gate, w_up, w_down, *, activation):
    y = _grouped_ffn(x_sorted, group_sizes.astype(jnp.int32), w_gate, w_up, w_down, activation)
    return y.astype(x_sorted.dtype)


def moe_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, activation):
    t, k = topk_ids.shape
    num_experts = w_gate.shape[0]
    pairs = t * k
    ids = topk_ids.reshape(-1)
    if pairs < num_experts:
        # Few tokens (decode): decode only the experts in use, at most t*k of them, instead of the
        # whole pool. Unused slots get the id num_experts (clipped for the gather) and no rows.
        active, ids = jnp.unique(ids, size=pairs, fill_value=num_experts, return_inverse=True)
        active = jnp.minimum(active, num_experts - 1)
        w_gate, w_up, w_down = (_take(w, active) for w in (w_gate, w_up, w_down))
        num_groups = pairs
    else:
        num_groups = num_experts
    ids = ids.reshape(-1)
    order = jnp.argsort(ids, stable=True)
    group_sizes = jnp.bincount(ids, length=num_groups).astype(jnp.int32)
    y_sorted = _grouped_ffn(x[order // k], group_sizes, w_gate, w_up, w_down, activation)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)
    return jnp.einsum("tk,tkd->td", topk_weights.astype(jnp.float32), y)
