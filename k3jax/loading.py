"""`from_pretrained`: a checkpoint directory -> K3Model.

Accepts a Hugging Face directory as published (safetensors, one file or shards) or a directory
written by `python -m convert` (Orbax, one item per layer). The model is built abstractly (nothing
allocated), then filled one decoder layer at a time: each layer's arrays are placed on the devices
as its own parameters, so host memory holds about one layer.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from convert.hf_params import HfParams
from convert.orbax_params import OrbaxParams, is_converted
from convert.reader import CheckpointError
from k3jax.config import K3Config
from k3jax.decoder import K3Transformer
from k3jax.model import K3Model, resolve_dtype
from k3jax.placement import check_mesh, put
from k3jax.vision.encoder import load_vision_encoder
from sharding.axes import named_sharding
from sharding.mesh import as_mesh


def embedded_dir(name: str) -> str:
    """The directory of a checkpoint shipped inside the package (k3jax/weights/NAME: k3-tiny, its
    DSpark draft k3-tiny-dspark)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights", name)


def from_pretrained(path: str | os.PathLike, *, dtype="bfloat16", mesh=None, vision: bool = True) -> K3Model:
    """Loads K3 or Kimi Linear from `path` (Hugging Face safetensors or a `python -m convert` output),
    with the vision tower as `model.vision` when the checkpoint has one and `vision` is set (else None:
    a text-only model, whose tower's tensors are not read).

    `dtype` ("bfloat16" or "float32") is the weight and activation dtype; the gate parameters, conv
    weights and router bias stay float32 and MXFP4 experts stay packed. `mesh` (None, a string such as
    "8x2", or a jax Mesh) places every parameter with the sharding of the logical-axis table
    (`sharding.axes`); each device gets only its slice, from host memory (safetensors) or straight
    from storage (Orbax).
    """
    cfg = K3Config.from_pretrained(path)
    mesh = as_mesh(mesh)
    source = OrbaxParams(path, cfg) if is_converted(path) else HfParams(path, cfg)
    abstract = nnx.eval_shape(lambda: K3Transformer(cfg, dtype=resolve_dtype(dtype)))
    graphdef, state = nnx.split(abstract)
    targets = dict(nnx.to_flat_state(state))
    if mesh is not None:
        check_mesh(cfg, mesh)

    values = {}
    _fill(values, targets, (), source.model(_shardings(targets, (), mesh)), mesh)
    for i in range(cfg.num_hidden_layers):
        prefix = ("layers", i)
        _fill(values, targets, prefix, source.layer(i, _shardings(targets, prefix, mesh)), mesh)
    source.check_unused()
    missing = sorted(".".join(map(str, p)) for p in targets if p not in values)
    if missing:
        raise CheckpointError(f"the checkpoint filled no value for parameters {missing[:5]}")
    params = nnx.from_flat_state([(p, targets[p].replace(values[p])) for p in targets])
    encoder = load_vision_encoder(path, cfg, dtype=dtype, mesh=mesh, source=source) if vision else None
    return K3Model(cfg, graphdef, params, mesh, encoder)


def _fill(values: dict, targets: dict, prefix: tuple, arrays: dict, mesh):
    """Places `arrays` (paths relative to `prefix`) into `values` with their parameters' dtype and sharding."""
    for rel, array in arrays.items():
        path = prefix + rel
        if path not in targets:
            raise CheckpointError(f"checkpoint array {'.'.join(map(str, path))} fills no parameter of this model")
        target = targets[path]
        shape = target.get_value().shape
        if tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"{'.'.join(map(str, path))}: the checkpoint gives shape {tuple(array.shape)}, "
                                  f"the model needs {tuple(shape)}")
        values[path] = _place(array, target.get_value().dtype, _sharding(mesh, target.logical_axes, shape))


def _shardings(targets: dict, prefix: tuple, mesh) -> dict | None:
    """Sharding of each array a source returns under `prefix`: () the model's own (embedding, norm,
    head), ("layers", i) one layer's."""
    if mesh is None:
        return None
    out = {}
    for path, v in targets.items():
        if path[:len(prefix)] == prefix and (prefix or path[0] != "layers"):
            out[path[len(prefix):]] = _sharding(mesh, v.logical_axes, v.get_value().shape)
    return out


def _sharding(mesh: Mesh | None, axes: tuple[str, ...], shape):
    return None if mesh is None else named_sharding(axes, tuple(shape), mesh)


def _place(array, dtype, sharding):
    dtype = jnp.dtype(dtype)
    if isinstance(array, jax.Array):  # restored from Orbax, already in its sharding
        array = array if array.dtype == dtype else array.astype(dtype)  # an eager astype compiles per shape
        return jax.device_put(array, sharding) if sharding else array
    host = np.asarray(array, dtype)
    if sharding is None:
        return jax.device_put(host)  # jnp.asarray would compile a staging op per shape
    return put(host, sharding)
