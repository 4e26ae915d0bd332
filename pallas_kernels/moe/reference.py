"""Obviously-correct MoE expert FFN: every row gathers its own expert's (dequantized) weights."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.moe.mxfp4 import Mxfp4Tensor, dequantize


def _weights(w, rows):
    """The [rows, out, in] float32 weights of the given expert per row."""
    if isinstance(w, Mxfp4Tensor):
        return dequantize(Mxfp4Tensor(w.packed[rows], w.scales[rows]), jnp.float32)
    return w[rows].astype(jnp.float32)


def _ffn(x, experts, w_gate, w_up, w_down, activation):
    x32 = x.astype(jnp.float32)
    gate = jnp.einsum("md,mfd->mf", x32, _weights(w_gate, experts))
    up = jnp.einsum("md,mfd->mf", x32, _weights(w_up, experts))
    hidden = activation(gate, up).astype(x.dtype).astype(jnp.float32)  # the kernels round here too
    return jnp.einsum("mf,mdf->md", hidden, _weights(w_down, experts))


def expert_ffn(x_sorted, group_sizes, w_gate, w_up, w_down, *, activation):
    m = x_sorted.shape[0]
    ends = jnp.cumsum(group_sizes)
    experts = jnp.searchsorted(ends, jnp.arange(m), side="right")
    inside = jnp.arange(m) < ends[-1]
    experts = jnp.minimum(experts, group_sizes.shape[0] - 1)
    y = _ffn(x_sorted, experts, w_gate, w_up, w_down, activation)
    return jnp.where(inside[:, None], y, 0.0).astype(x_sorted.dtype)


def moe_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, activation):
    t, k = topk_ids.shape
    rows = jnp.repeat(x, k, axis=0)
    y = _ffn(rows, topk_ids.reshape(-1), w_gate, w_up, w_down, activation).reshape(t, k, -1)
    return jnp.einsum("tk,tkd->td", topk_weights.astype(jnp.float32), y)
