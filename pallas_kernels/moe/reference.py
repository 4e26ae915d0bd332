"""Obviously-correct MoE expert FFN (the test oracle): every row gathers and dequantizes its own
expert's weights and runs the FFN in fp32 (tiny shapes only: memory is rows x F x D)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe.mxfp4 import Mxfp4Tensor, dequantize

_HIGHEST = jax.lax.Precision.HIGHEST  # no reduced-precision fp32 matmuls (TF32) in the oracle


def _weights(w, experts):
    """fp32 [rows, out, in]: the weight of each row's expert."""
    if isinstance(w, Mxfp4Tensor):
        return dequantize(Mxfp4Tensor(w.packed[experts], w.scales[experts]), jnp.float32)
    return w[experts].astype(jnp.float32)


def _ffn(x, experts, w_gate, w_up, w_down, activation):
    """[rows, D] in x's dtype: each row through its expert. Weights are cast to x's dtype first, as
    the other implementations do (a no-op for MXFP4, exact in bf16)."""
    x32 = x.astype(jnp.float32)
    w_gate, w_up, w_down = (_weights(w, experts).astype(x.dtype).astype(jnp.float32) for w in (w_gate, w_up, w_down))
    gate = jnp.einsum("md,mfd->mf", x32, w_gate, precision=_HIGHEST)
    up = jnp.einsum("md,mfd->mf", x32, w_up, precision=_HIGHEST)
    hidden = activation(gate, up).astype(x.dtype).astype(jnp.float32)  # rounded before down, as the model
    return jnp.einsum("mf,mdf->md", hidden, w_down, precision=_HIGHEST).astype(x.dtype)


def expert_ffn(x_sorted, group_sizes, w_gate, w_up, w_down, *, activation):
    rows = jnp.arange(x_sorted.shape[0])
    ends = jnp.cumsum(group_sizes)
    experts = jnp.searchsorted(ends, rows, side="right")  # first group whose end is past the row
    experts = jnp.minimum(experts, group_sizes.shape[0] - 1)  # padding rows: any expert, zeroed below
    y = _ffn(x_sorted, experts, w_gate, w_up, w_down, activation)
    return jnp.where((rows < ends[-1])[:, None], y, 0)


def moe_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, activation):
    t, k = topk_ids.shape
    y = _ffn(jnp.repeat(x, k, axis=0), topk_ids.reshape(-1), w_gate, w_up, w_down, activation)
    return jnp.sum(topk_weights.astype(jnp.float32)[..., None] * y.reshape(t, k, -1).astype(jnp.float32), axis=1)
