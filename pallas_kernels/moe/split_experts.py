"""Routed-expert weights held one buffer per expert: the layout the XLA expert loop reads on CPU.

XLA:CPU cannot hand a dot a dynamic slice of a stacked [E, out, in] weight in place: the stacked
loop copies each expert in use out of its stack before multiplying (a write and a second read of
every expert a step uses). Held as E separate buffers, each expert's dot reads its own buffer in
place, but every expert then costs a branch of its own (about 6 us on XLA:CPU, used or not), so
splitting pays only for large experts. `pallas_kernels.moe.xla.expert_ffn`, 32 experts, top-4, fp32,
gate + up + down, medians of 40 interleaved runs on 2 shared cores (stacked -> split, ms):

    one matrix   1 token         4 tokens
    32 KiB       0.13 -> 0.25    0.15 -> 0.32
    128 KiB      0.17 -> 0.29    0.39 -> 0.54
    512 KiB      0.57 -> 0.58    1.82 -> 1.24
    2 MiB        2.94 -> 1.35    17.5 -> 8.9

hence SPLIT_MIN_BYTES. GPU keeps the stack: the Pallas kernel reads any expert of it by address.

The gate and up weights are split together (`split_gate_up`): each expert's two matrices stacked
along `out` in one buffer, so one matrix-vector product reads both. XLA:CPU runs a one-row product
on one core up to about 2 MiB of weight and on both above (Eigen's cost model); in a decode step
every weight comes from memory, and a 4 MiB [1024, 1024] fp32 product read 26 GB/s against 14 GB/s
for the 2 MiB [512, 1024] one (medians over 384 different matrices, so nothing stays in cache).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.moe.mxfp4 import Mxfp4Tensor

SPLIT_MIN_BYTES = 512 * 1024  # one expert's matrix as stored, from which SplitExperts pays (table above)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class SplitExperts:
    """One weight's E experts, each an [out, in] array or Mxfp4Tensor of its own.

    gate_up: the gate weight of `split_gate_up`: each buffer is an expert's [gate; up], [2F, in];
    the up weight is then `SplitExperts((), gate_up=True)`, a placeholder without buffers.
    """

    experts: tuple
    gate_up: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [E, out, in] shape, as of the stacked weight (of the gate alone for gate_up)."""
        out, inp = self.experts[0].shape
        return (len(self.experts), out // 2 if self.gate_up else out, inp)

    @property
    def is_placeholder(self) -> bool:
        return self.gate_up and not self.experts

    def tree_flatten(self):
        return self.experts, self.gate_up

    @classmethod
    def tree_unflatten(cls, gate_up, experts):
        return cls(tuple(experts), gate_up)


def split_experts(w) -> SplitExperts:
    """A stacked [E, out, in] array or Mxfp4Tensor as E separate buffers (each a new buffer)."""
    if isinstance(w, Mxfp4Tensor):
        return SplitExperts(tuple(Mxfp4Tensor(p, s) for p, s in zip(split_experts(w.packed).experts,
                                                                     split_experts(w.scales).experts)))
    return SplitExperts(tuple(w[e] for e in range(w.shape[0])))


def split_gate_up(w_gate, w_up) -> tuple[SplitExperts, SplitExperts]:
    """Stacked gate and up weights [E, F, in] (arrays or Mxfp4Tensors) as one buffer per expert
    holding both, [2F, in], and the placeholder that stands for the up weight."""
    if isinstance(w_gate, Mxfp4Tensor):
        packed, _ = split_gate_up(w_gate.packed, w_up.packed)
        scales, _ = split_gate_up(w_gate.scales, w_up.scales)
        fused = tuple(map(Mxfp4Tensor, packed.experts, scales.experts))
    else:  # expert by expert: concatenating the stacks first would hold a second copy of both at load
        fused = tuple(jnp.concatenate([w_gate[e], w_up[e]]) for e in range(w_gate.shape[0]))
    return SplitExperts(fused, gate_up=True), SplitExperts((), gate_up=True)


def stacked(w_gate, w_up, w_down) -> tuple:
    """The stacked [E, out, in] weights of SplitExperts (copies); stacked weights as they are."""
    if isinstance(w_gate, SplitExperts) and w_gate.gate_up:
        f = w_gate.shape[1]
        halves = [_stack(w_gate.experts, slice(0, f)), _stack(w_gate.experts, slice(f, 2 * f))]
        return (*halves, _stack_split(w_down))
    return tuple(map(_stack_split, (w_gate, w_up, w_down)))


def _stack_split(w):
    return _stack(w.experts, slice(None)) if isinstance(w, SplitExperts) else w


def _stack(experts, rows: slice):
    if isinstance(experts[0], Mxfp4Tensor):
        return Mxfp4Tensor(jnp.stack([e.packed[rows] for e in experts]), jnp.stack([e.scales[rows] for e in experts]))
    return jnp.stack([e[rows] for e in experts])
