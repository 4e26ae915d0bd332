"""`from_pretrained`: a checkpoint directory -> K3Model.

Accepts a Hugging Face directory as published (safetensors, one file or shards) or a directory
written by `python -m convert` (Orbax, one item per layer). The model is built abstractly (nothing
allocated), then filled one decoder layer at a time: each layer's arrays are placed on the devices
and written into their slot of the stacked segment parameters in place, so host memory holds about
one layer and device memory never holds a segment twice.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from convert.hf_params import HfParams
from convert.orbax_params import OrbaxParams, is_converted
from convert.reader import CheckpointError
from k3jax.config import K3Config
from k3jax.decoder import K3Transformer, plan_segments
from k3jax.model import K3Model, resolve_dtype
from sharding.mesh import make_mesh


def from_pretrained(path: str | os.PathLike, *, dtype="bfloat16", mesh=None) -> K3Model:
    """Loads K3 or Kimi Linear from `path` (Hugging Face safetensors or a `python -m convert` output).

    `dtype` ("bfloat16" or "float32") is the weight and activation dtype; the gate parameters, conv
    weights and router bias stay float32 and MXFP4 experts stay packed. `mesh` (None, a string such as
    "8x2", or a jax Mesh) places every parameter on the mesh; until the sharding table lands
    ([sharding] issue) parameters are replicated there, and each device still gets only its slice
    from the host (safetensors) or from storage (Orbax).
    """
    cfg = K3Config.from_pretrained(path)
    mesh = make_mesh(mesh) if isinstance(mesh, str) else mesh
    source = OrbaxParams(path, cfg) if is_converted(path) else HfParams(path, cfg)
    abstract = nnx.eval_shape(lambda: K3Transformer(cfg, dtype=resolve_dtype(dtype)))
    graphdef, state = nnx.split(abstract)
    targets = dict(nnx.to_flat_state(state))
    if isinstance(source, OrbaxParams):
        source.shardings = lambda path, shape: _sharding(mesh, len(shape))

    values = {}
    _fill(values, targets, (), source.model(), mesh)
    for s, seg in enumerate(plan_segments(cfg)):
        for j in range(len(seg.kinds)):
            for r in range(seg.repeats):
                _fill(values, targets, ("segments", s, "layers", j), source.layer(seg.layer_index(j, r)), mesh, r)
    source.check_unused()
    missing = sorted(".".join(map(str, p)) for p in targets if p not in values)
    if missing:
        raise CheckpointError(f"the checkpoint filled no value for parameters {missing[:5]}")
    params = nnx.from_flat_state([(p, targets[p].replace(values[p])) for p in targets])
    return K3Model(cfg, graphdef, params)


def _fill(values: dict, targets: dict, prefix: tuple, arrays: dict, mesh, row: int | None = None):
    """Places `arrays` (paths relative to `prefix`) into `values`, as row `row` of stacked parameters when given."""
    placed = {}
    for rel, array in arrays.items():
        path = prefix + rel
        if path not in targets:
            raise CheckpointError(f"checkpoint array {'.'.join(map(str, path))} fills no parameter of this model")
        target = targets[path].get_value()
        shape = target.shape if row is None else target.shape[1:]
        if tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"{'.'.join(map(str, path))}: the checkpoint gives shape {tuple(array.shape)}, "
                                  f"the model needs {tuple(shape)}")
        placed[path] = _place(array, target.dtype, _sharding(mesh, len(shape)))
    if row is None:
        values.update(placed)
        return
    if row == 0:  # first layer of the segment position: allocate the stacked parameters once
        shapes = {p: (targets[p].get_value().shape, targets[p].get_value().dtype) for p in placed}
        values.update(_zeros(shapes, mesh))
    stacked = _set_rows({p: values[p] for p in placed}, row, placed)
    values.update(stacked)


def _sharding(mesh: Mesh | None, ndim: int):
    """The placement of a parameter: replicated over the mesh until the sharding table lands."""
    if mesh is None:
        return None
    return NamedSharding(mesh, PartitionSpec(*([None] * ndim)))


def _place(array, dtype, sharding):
    if isinstance(array, jax.Array):
        return jax.device_put(array.astype(dtype), sharding) if sharding else array.astype(dtype)
    host = np.asarray(array).astype(jnp.dtype(dtype))
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])  # per-device slices


def _zeros(shapes: dict, mesh):
    shardings = {p: _sharding(mesh, len(shape)) for p, (shape, _) in shapes.items()}
    make = jax.jit(lambda: {p: jnp.zeros(shape, dtype) for p, (shape, dtype) in shapes.items()},
                   out_shardings=shardings if mesh is not None else None)
    return make()


@functools.partial(jax.jit, donate_argnums=0)
def _set_rows(stacked: dict, r, rows: dict):
    """Writes one layer into row r of every stacked parameter, in place (the buffers are donated)."""
    return {p: jax.lax.dynamic_update_index_in_dim(stacked[p], rows[p].astype(stacked[p].dtype), r, axis=0)
            for p in stacked}
