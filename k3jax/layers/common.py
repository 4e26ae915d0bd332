"""Parameters, linear layers and norms shared by every layer.

Parameters carry their logical axis names as `logical_axes` metadata (ARCHITECTURE.md, "Meshes"); the
sharding package maps those names to mesh axes. Linear kernels are stored [out, in], as the checkpoint
stores them (`pallas_kernels.linear` says why), and every projection is bias-free.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from pallas_kernels.linear import linear
from sharding.mesh import DATA


def param(rngs: nnx.Rngs | None, shape, axes: tuple[str, ...], dtype, init: str = "normal",
          stddev: float | None = None) -> nnx.Param:
    """A parameter with logical axes; `init` is "normal" (fan-in scaled unless stddev), "ones" or "zeros".

    Without rngs the value is zeros of the right shape: used for abstract models that a checkpoint
    fills in (under nnx.eval_shape nothing is allocated at all).
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros" or rngs is None:
        value = jnp.zeros(shape, dtype)
    elif init == "normal":
        std = stddev if stddev is not None else shape[0] ** -0.5
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    else:
        raise ValueError(f"unknown init {init!r}")
    return nnx.Param(value, logical_axes=axes)


def transposed(p: nnx.Param) -> nnx.Param:
    """A 2-D parameter transposed, logical axes too: kernels kept [out, in] are drawn [in, out], so a
    seed gives the same random model as it did when kernels were kept [in, out]."""
    return nnx.Param(p.get_value().T, logical_axes=p.get_metadata()["logical_axes"][::-1])


class Linear(nnx.Module):
    """y = x @ kernel^T, kernel [out, in]; fp32 accumulation, output in x's dtype. `axes` names the
    (in, out) logical axes."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str, str], *, dtype, rngs,
                 stddev: float | None = None):
        self.kernel = transposed(param(rngs, (in_features, out_features), axes, dtype, stddev=stddev))

    def __call__(self, x, out_dtype=None):
        return linear(x, self.kernel[...], out_dtype or x.dtype)


class RMSNorm(nnx.Module):
    """w * x / sqrt(mean(x^2) + eps), computed in fp32 (weight used as stored, no 1 + w offset)."""

    def __init__(self, size: int, eps: float, *, dtype, axis_name: str = "norm"):
        self.weight = param(None, (size,), (axis_name,), dtype, init="ones")
        self.eps = eps

    def __call__(self, x, out_dtype=None):
        return rms_norm(x, self.weight[...], self.eps, out_dtype or x.dtype)


def rms_norm(x, weight, eps: float, out_dtype):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(out_dtype)


def per_group(fn, groups: int, *args):
    """fn(*args) on each data group's block of every argument's leading axis, on that group's devices
    (`data` manual, heads still split over `model` inside), the results joined again: DP attention's
    pool reads and writes (k3jax.decoder.PagedState.groups), where rows and pool entries both split
    over `data` in blocks and row block g uses only pool block g, its ids local to the block. With
    global ids the partitioner would move pools between groups; a Pallas kernel inside sees its own
    group's pool block and table alone."""
    if groups == 1:
        return fn(*args)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(DATA) != groups:
        raise ValueError(f"{groups} DP attention groups need a mesh with data={groups} set around the call")
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(PartitionSpec(DATA) for _ in args),
                         out_specs=PartitionSpec(DATA), axis_names={DATA}, check_vma=False)(*args)
