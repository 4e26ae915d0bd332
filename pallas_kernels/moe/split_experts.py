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
    """One weight's E experts, each an [out, in] array or Mxfp4Tensor of its own."""

    experts: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [E, out, in] shape, as of the stacked weight."""
        return (len(self.experts), *self.experts[0].shape)

    def tree_flatten(self):
        return self.experts, None

    @classmethod
    def tree_unflatten(cls, _, experts):
        return cls(tuple(experts))


def split_experts(w) -> SplitExperts:
    """A stacked [E, out, in] array or Mxfp4Tensor as E separate buffers (each a new buffer)."""
    if isinstance(w, Mxfp4Tensor):
        return SplitExperts(tuple(Mxfp4Tensor(p, s) for p, s in zip(split_experts(w.packed).experts,
                                                                     split_experts(w.scales).experts)))
    return SplitExperts(tuple(w[e] for e in range(w.shape[0])))


def stacked(w):
    """The stacked [E, out, in] weight of SplitExperts (a copy), anything else as it is."""
    if not isinstance(w, SplitExperts):
        return w
    if isinstance(w.experts[0], Mxfp4Tensor):
        return Mxfp4Tensor(jnp.stack([e.packed for e in w.experts]), jnp.stack([e.scales for e in w.experts]))
    return jnp.stack(w.experts)
