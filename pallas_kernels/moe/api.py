"""MoE expert FFN ops (DESIGN.md section 3). `impl="auto"` picks XLA until the Pallas kernel lands.

Expert weights are [E, out, in] in the checkpoint's orientation, either an `Mxfp4Tensor` (K3) or a
plain array (Kimi Linear); w_gate and w_up are [E, F, D], w_down [E, D, F].
"""

from __future__ import annotations

from pallas_kernels.activations import GatedActivation
from pallas_kernels.moe import reference, xla

_IMPLS = {"xla": xla, "reference": reference}


def _module(impl: str):
    if impl == "auto":
        return xla
    if impl == "pallas":
        raise ValueError("impl='pallas': the Pallas MXFP4 grouped-matmul kernel is not available yet; "
                         "use 'auto' or 'xla'")
    if impl not in _IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose 'auto', 'xla' or 'reference'")
    return _IMPLS[impl]


def expert_ffn(x_sorted, group_sizes, w_gate, w_up, w_down, *, activation: GatedActivation, impl: str = "auto"):
    """Grouped gated FFN over rows sorted by expert: x_sorted [M, D], group_sizes int32 [E] (rows of
    expert e contiguous, in expert order; rows past the sum are padding and give zeros). Matmuls
    accumulate in fp32; the activation output is cast to x's dtype before the down projection.
    Returns [M, D] in x's dtype."""
    _check(x_sorted, w_gate, w_up, w_down)
    if group_sizes.shape != (w_gate.shape[0],):
        raise ValueError(f"group_sizes has shape {group_sizes.shape}, expected ({w_gate.shape[0]},): one per expert")
    return _module(impl).expert_ffn(x_sorted, group_sizes, w_gate, w_up, w_down, activation=activation)


def moe_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, activation: GatedActivation, impl: str = "auto"):
    """Routed experts for tokens x [T, D] with topk_ids int32 [T, k] and topk_weights [T, k]:
    out[t] = sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t]), accumulated in fp32.
    Returns float32 [T, D]."""
    _check(x, w_gate, w_up, w_down)
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {topk_ids.shape} and topk_weights {topk_weights.shape} must both be "
                         f"[T={x.shape[0]}, k]")
    return _module(impl).moe_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, activation=activation)


def _check(x, w_gate, w_up, w_down):
    e, f, d = w_gate.shape
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"x has shape {x.shape}, expected [rows, {d}] to match w_gate {tuple(w_gate.shape)}")
    if tuple(w_up.shape) != (e, f, d) or tuple(w_down.shape) != (e, d, f):
        raise ValueError(f"expert weights disagree: w_gate {tuple(w_gate.shape)}, w_up {tuple(w_up.shape)}, "
                         f"w_down {tuple(w_down.shape)} (expected [E, F, D], [E, F, D], [E, D, F])")
