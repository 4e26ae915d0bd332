"""Which implementation an op runs, and running a Pallas kernel once per shard under a mesh.

impl="auto" picks the Pallas kernels on a GPU when the shapes suit them and the XLA path otherwise.
The environment variable K3JAX_KERNELS overrides that choice for every op: "xla" keeps a GPU on the
XLA paths (to compare or to debug), "pallas" runs the kernels wherever the shapes suit them, in
interpret mode off a GPU (slow: for tests). It is read when a function is traced, so set it before
the first call of a jitted step.

A Pallas call is a custom call that XLA cannot partition: under a sharded jit it would gather every
operand onto each device. `per_shard` therefore runs it inside `shard_map` over the mesh set with
`jax.set_mesh`, each device on its own heads (`model`) and, for ops that only read their operands,
its own rows (`data`).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import PartitionSpec

from sharding.mesh import DATA, MODEL

IMPLS = ("auto", "xla", "reference", "pallas")
ENV = "K3JAX_KERNELS"
# A dimension's role, and the mesh axis it splits over when the mesh divides it.
ROLE_AXES = {"heads": MODEL, "rows": DATA}


def resolve(impl: str, pallas_fits: bool, shapes: str) -> str:
    """The implementation to run: "xla", "reference" or "pallas". Refuses impl="pallas" on shapes the
    kernel does not take, naming them (`shapes`)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose one of {', '.join(map(repr, IMPLS))}")
    if impl == "auto":
        preferred = os.environ.get(ENV, "auto")
        if preferred not in ("auto", "xla", "pallas"):
            raise ValueError(f"{ENV}={preferred!r}; choose 'auto', 'xla' or 'pallas'")
        wants_pallas = preferred == "pallas" or (preferred == "auto" and on_gpu())
        return "pallas" if wants_pallas and pallas_fits else "xla"
    if impl == "pallas" and not pallas_fits:
        raise ValueError(f"impl='pallas' does not take these shapes ({shapes})")
    return impl


def on_gpu() -> bool:
    """Asked per call: asking for the backend at import would initialise it."""
    return jax.default_backend() == "gpu"


def per_shard(kernel, args: tuple, roles: tuple, out_roles):
    """kernel(*args), run once per shard when a mesh with automatic axes of size > 1 is set.

    roles: one entry per argument, a tuple naming each dimension's role ("heads", "rows" or None), or
    None for an array every shard gets whole. Arguments that are not arrays (None, Python numbers)
    reach the kernel as they are. out_roles: the
    same for the result, a tuple of such tuples (or None for a None result). A dimension is split
    only when the mesh divides it; every array with that role must then have the same size there.
    Without a mesh (or inside a shard_map already) the kernel is called as it is.
    """
    mesh = jax.sharding.get_abstract_mesh()
    ways = {axis: size for axis, size in (() if mesh.empty else mesh.shape.items())
            if size > 1 and axis not in mesh.manual_axes}
    if not ways:
        return kernel(*args)
    sizes = {}
    for arg, arg_roles in zip(args, roles):
        for role, size in zip(arg_roles or (), getattr(arg, "shape", ())):
            if role is not None:
                sizes.setdefault(role, size)
    split = {role: axis for role, axis in ROLE_AXES.items()
             if role in sizes and axis in ways and sizes[role] % ways[axis] == 0}

    def spec(dim_roles):
        return None if dim_roles is None else PartitionSpec(*(split.get(role) for role in dim_roles))

    arrays = [i for i, arg in enumerate(args) if isinstance(arg, (jax.Array, np.ndarray))]

    def body(*shards):
        full = list(args)
        for i, shard in zip(arrays, shards):
            full[i] = shard
        return kernel(*full)

    in_specs = tuple(spec(roles[i]) or PartitionSpec() for i in arrays)
    out_specs = jax.tree.map(spec, out_roles, is_leaf=_is_roles)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        *(args[i] for i in arrays))


def _is_roles(x) -> bool:
    """A leaf of out_roles: one array's dimension roles."""
    return x is None or (isinstance(x, tuple) and all(r is None or isinstance(r, str) for r in x))
