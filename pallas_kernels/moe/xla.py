"""MoE expert FFN in plain XLA, on expert weights dequantized to the activation dtype (bf16 x bf16
products are exact in fp32, so this is W4A16 with fp32 accumulation).

Two strategies for the grouped matmuls:

- "loop" (the CPU default): a loop over the non-empty experts only, each dequantizing its weights
  once and running its rows in fixed-size tiles; empty groups cost nothing. XLA:CPU has no ragged
  dot: JAX lowers `lax.ragged_dot` there to a masked dense matmul of every row against every group
  (measured: the cost grows linearly with the number of groups), a dense loop over all experts.
- "ragged_dot" (other backends): `lax.ragged_dot`, lowered to the native ragged-dot instruction on
  GPU and TPU (not measured here). With fewer rows than experts (decode) only the experts in use
  are gathered and dequantized.

`moe_ffn` has a third, "dense", for training small expert pools (k3jax.train): every token through
every expert, each output weighed by the token's gate for it (zero outside its top-k). It does E/k
times the routed products' work, but as three plain batched dots with no sort, no scatter and no
data-dependent loop, so it differentiates and XLA:CPU runs it fast: one k3-tiny MoE layer's forward
and backward at the training batch (4096 tokens, top-4 of 16 experts of 32 x 32) took 101 ms against
168 with "ragged_dot", which XLA:CPU lowers to a masked product of all 16384 (token, slot) rows
against all 16 experts (benchmarks/train_moe.py, 2 cores).

Weights held as `SplitExperts` (one buffer per expert, the CPU layout) run the loop unrolled over
the experts instead, each reading its own buffer in place; an expert without rows runs no tile.
Gate and up split together (`split_gate_up`) run as one product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.linear import linear
from pallas_kernels.moe.mxfp4 import Mxfp4Tensor, dequantize
from pallas_kernels.moe.split_experts import SplitExperts


def expert_ffn(x_sorted, group_sizes, w_gate, w_up, w_down, *, activation, strategy: str | None = None):
    """See `pallas_kernels.moe.api.expert_ffn`. strategy: "loop", "ragged_dot" or None (by backend)."""
    strategy = strategy or ("loop" if jax.default_backend() == "cpu" else "ragged_dot")
    if strategy not in ("loop", "ragged_dot"):
        raise ValueError(f"unknown grouped-matmul strategy {strategy!r}; expected 'loop' or 'ragged_dot' "
                         "('dense' is moe_ffn's alone)")
    group_sizes = group_sizes.astype(jnp.int32)
    if isinstance(w_gate, SplitExperts):
        if strategy != "loop":
            raise ValueError("SplitExperts weights run the 'loop' strategy only; stack them for 'ragged_dot'")
        return _split_loop_ffn(x_sorted, group_sizes, w_gate, w_up, w_down, activation).astype(x_sorted.dtype)
    run = _loop_ffn if strategy == "loop" else _ragged_ffn
    return run(x_sorted, group_sizes, w_gate, w_up, w_down, activation).astype(x_sorted.dtype)


def moe_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, activation, strategy: str | None = None):
    """See `pallas_kernels.moe.api.moe_ffn`. strategy: "dense", or expert_ffn's."""
    if strategy == "dense":
        if isinstance(w_gate, SplitExperts):
            raise ValueError("SplitExperts weights run the 'loop' strategy only; stack them for 'dense'")
        return _dense_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, activation)
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(ids, stable=True)  # (token, slot) pairs grouped by expert
    group_sizes = jnp.bincount(ids, length=w_gate.shape[0])
    y_sorted = expert_ffn(x[order // k], group_sizes, w_gate, w_up, w_down, activation=activation,
                          strategy=strategy)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)  # back to pair order
    return jnp.sum(topk_weights.astype(jnp.float32)[..., None] * y.astype(jnp.float32), axis=1)


def _dense_ffn(x_TD, topk_ids, topk_weights, w_gate, w_up, w_down, activation):
    t, num_experts = x_TD.shape[0], w_gate.shape[0]
    gates_TE = jnp.zeros((t, num_experts), jnp.float32).at[jnp.arange(t)[:, None], topk_ids].add(
        topk_weights.astype(jnp.float32))
    gate_TEF, up_TEF = (jnp.einsum("td,efd->tef", x_TD, _dense(w, x_TD.dtype), preferred_element_type=jnp.float32)
                        for w in (w_gate, w_up))
    hidden_TEF = activation(gate_TEF, up_TEF).astype(x_TD.dtype).astype(jnp.float32) * gates_TE[..., None]
    return jnp.einsum("tef,edf->td", hidden_TEF, _dense(w_down, jnp.float32))


def _dense(w, dtype):
    return dequantize(w, dtype) if isinstance(w, Mxfp4Tensor) else w.astype(dtype)


def _take(w, experts):
    return Mxfp4Tensor(w.packed[experts], w.scales[experts]) if isinstance(w, Mxfp4Tensor) else w[experts]


def _ragged_ffn(x, group_sizes, w_gate, w_up, w_down, activation):
    m, num_experts = x.shape[0], group_sizes.shape[0]
    if m < num_experts:
        # At most m groups are non-empty: gather those experts' (packed) weights and dequantize only
        # them rather than the whole pool. nonzero keeps expert order, so the sorted rows still line
        # up; padding slots point one past the last expert, whose group size is 0.
        (active,) = jnp.nonzero(group_sizes > 0, size=m, fill_value=num_experts)
        group_sizes = jnp.append(group_sizes, 0)[active]
        active = jnp.minimum(active, num_experts - 1)
        w_gate, w_up, w_down = (_take(w, active) for w in (w_gate, w_up, w_down))

    def matmul(lhs, w):  # w [groups, out, in]; ragged_dot wants the rhs as [groups, in, out]
        rhs = jnp.swapaxes(_dense(w, x.dtype), 1, 2)
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)

    hidden = activation(matmul(x, w_gate), matmul(x, w_up)).astype(x.dtype)
    padding = (jnp.arange(m) >= jnp.sum(group_sizes))[:, None]  # zeros whatever the backend leaves there
    return jnp.where(padding, 0.0, matmul(hidden, w_down))


def _tile_rows(m: int, num_experts: int, *, split: bool) -> int:
    """Rows per tile. When nearly every non-empty group has one row (batch-1 decode), one: a one-row
    product is a matrix-vector product, which XLA:CPU runs on both cores once the weight passes about
    2 MiB (split_experts.py). Otherwise the power of two at or above the mean group size, at most 512
    and m, and at least 4 for split (large) experts or 16 for stacked (small) ones; each non-empty group
    wastes less than one tile.

    Large experts come from memory: products of 2 to 4 rows read a 4 MiB weight at 21 GB/s and of 16
    rows at 17 (`pallas_kernels.linear`), so a batch-16 step's MoE layer, its 64 rows over 28 of 32 experts,
    took 12.0 ms with 4-row tiles against 17.5 with 16 (fp32, D 1024, F 512). Small experts stay in
    cache, where a tile costs its ops, not its bytes: on k3-tiny (16 experts of 32 x 32), a batch-4
    step took 1.4 ms with one-row tiles against 1.85 with 4 (medians of interleaved runs)."""
    if (4 * m if split else m) <= num_experts:
        return 1
    mean = -(-m // num_experts)
    return min(m, max(4 if split else 16, min(512, 1 << (mean - 1).bit_length())))


def _loop_ffn(x_MD, group_sizes, w_gate, w_up, w_down, activation):
    m, num_experts = x_MD.shape[0], group_sizes.shape[0]
    tile = _tile_rows(m, num_experts, split=False)
    ends = jnp.cumsum(group_sizes)
    (active,) = jnp.nonzero(group_sizes > 0, size=min(m, num_experts), fill_value=0)  # <= m non-empty
    num_active = jnp.count_nonzero(group_sizes)

    def one_expert(i, out):
        e = active[i]
        gate_FD, up_FD, down_DF = (_dense(_take(w, e), x_MD.dtype) for w in (w_gate, w_up, w_down))
        hidden = functools.partial(_gated, gate_FD, up_FD, activation)
        return _expert_rows(x_MD, out, ends[e] - group_sizes[e], ends[e], tile, hidden, down_DF)

    return jax.lax.fori_loop(0, num_active, one_expert, jnp.zeros_like(x_MD))  # padding rows stay 0


def _split_loop_ffn(x_MD, group_sizes, w_gate, w_up, w_down, activation):
    m, num_experts = x_MD.shape[0], group_sizes.shape[0]
    tile = _tile_rows(m, num_experts, split=True)
    ends = jnp.cumsum(group_sizes)

    def one_expert(e, out):
        if w_gate.gate_up:  # [gate; up] in one buffer: one product for both
            gate_up_2FD = _dense(w_gate.experts[e], x_MD.dtype)
            hidden = functools.partial(_gated_fused, gate_up_2FD, activation)
        else:
            hidden = functools.partial(_gated, *(_dense(w.experts[e], x_MD.dtype) for w in (w_gate, w_up)), activation)
        down_DF = _dense(w_down.experts[e], x_MD.dtype)
        return _expert_rows(x_MD, out, ends[e] - group_sizes[e], ends[e], tile, hidden, down_DF)

    out = jnp.zeros_like(x_MD)  # padding rows stay 0
    for e in range(num_experts):  # an expert without rows skips its dequantization too
        out = jax.lax.cond(group_sizes[e] > 0, functools.partial(one_expert, e), lambda out: out, out)
    return out


def _gated(gate_FD, up_FD, activation, x_TD):
    return activation(linear(x_TD, gate_FD), linear(x_TD, up_FD)).astype(x_TD.dtype)


def _gated_fused(gate_up_2FD, activation, x_TD):
    gate_up_T2F = linear(x_TD, gate_up_2FD)
    f = gate_up_2FD.shape[0] // 2
    return activation(gate_up_T2F[:, :f], gate_up_T2F[:, f:]).astype(x_TD.dtype)


def _expert_rows(x_MD, out_MD, start, end, tile, hidden, w_down_DF):
    """out_MD with its rows [start, end) (at least one) set to one expert's FFN of x_MD's, run in
    `tile`-row tiles; hidden(x [tile, D]) -> [tile, F]. The first tile runs outside the loop:
    XLA:CPU compiles a loop this small into one function whose products are its own code on one
    core, where outside it they are library calls (both cores for large weights)."""
    m = x_MD.shape[0]

    def one_tile(j, out):
        first = start + j * tile
        at = jnp.minimum(first, m - tile)  # the last tile slides back to stay inside x
        rows = at + jnp.arange(tile)
        hidden_TF = hidden(jax.lax.dynamic_slice_in_dim(x_MD, at, tile))
        y = linear(hidden_TF, w_down_DF, x_MD.dtype)  # [tile, D]
        mine = ((rows >= first) & (rows < end))[:, None]  # leave other groups' rows untouched
        y = jnp.where(mine, y, jax.lax.dynamic_slice_in_dim(out, at, tile))
        return jax.lax.dynamic_update_slice_in_dim(out, y, at, axis=0)

    return jax.lax.fori_loop(1, (end - start + tile - 1) // tile, one_tile, one_tile(0, out_MD))
