"""Where every parameter and cache array lives on a mesh: the logical axes the model declares,
mapped through the one table in `sharding.axes`."""

from __future__ import annotations

import collections

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from k3jax.config import K3Config
from k3jax.decoder import DecodeState
from k3jax.layers.kda import KDACache
from k3jax.layers.mla import MLACache, MLAPages
from pallas_kernels.moe import SPLIT_MIN_BYTES, SplitExperts, split_experts, split_gate_up
from sharding.axes import named_sharding
from sharding.mesh import DATA, MODEL

CACHE_AXES = {  # per-sequence caches (`DecodeState`): sequences split over `data` like the batch
    KDACache: KDACache(conv=("batch", "conv_tap", "qkv", "cache_channels"),
                       state=("batch", "cache_heads", "head_dim", "head_dim")),
    MLACache: MLACache(latent=("batch", "sequence", "cache_width")),
}
POOL_AXES = {  # the serving engine's pools: each data group holds its own block of slots and pages (serve/runner.py)
    KDACache: KDACache(conv=("slots", "conv_tap", "qkv", "cache_channels"),
                       state=("slots", "cache_heads", "head_dim", "head_dim")),
    MLAPages: MLAPages(pages=("pages", "page_rows", "cache_width"), scale=()),
}


def check_mesh(cfg: K3Config, mesh: Mesh) -> None:
    """Whole heads and whole experts per device, or an error saying what does not divide."""
    model, devices = mesh.shape[MODEL], mesh.shape[MODEL] * mesh.shape[DATA]
    counts = [(cfg.kda_num_heads, "KDA heads", MODEL, model), (cfg.num_attention_heads, "MLA heads", MODEL, model)]
    if cfg.num_experts:
        counts.append((cfg.num_experts, "routed experts", "data x model", devices))
    for count, what, axis, ways in counts:
        if count % ways:
            raise ValueError(f"{count} {what} do not divide over {axis}={ways}")


def place_params(params: nnx.State, mesh: Mesh) -> nnx.State:
    """Each parameter onto the mesh with the sharding its logical axes name."""

    def place(v):
        sharding = named_sharding(v.logical_axes, v.shape, mesh)
        value = v.get_value()
        if isinstance(value, jax.Array):
            if value.sharding.is_equivalent_to(sharding, value.ndim):
                return v
            if not value.is_fully_addressable:  # spans processes: reshard on the devices, not via the host
                return v.replace(jax.device_put(value, sharding))
        return v.replace(put(value, sharding))

    return jax.tree.map(place, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def split_routed_experts(params: nnx.State, min_bytes: int = SPLIT_MIN_BYTES) -> nnx.State:
    """The routed experts' stacked [E, out, in] weights as SplitExperts, one buffer per expert, where
    one expert's matrix holds at least `min_bytes` (MXFP4: codes and scales together): the layout the
    XLA expert loop reads in place on CPU (pallas_kernels/moe/split_experts.py, which measured where
    splitting starts to pay). The gate (w1) and up (w3) weights are split together, w1 holding both
    and w3 the placeholder."""
    flat = dict(nnx.to_flat_state(params))
    routed = {("experts", w) for w in ("w1", "w2", "w3")}  # RoutedExperts' weights: arrays, or MXFP4's two

    def weight(path):  # the routed weight an array belongs to (MXFP4's codes and scales one level down), or None
        return next((tuple(path[:i]) for i in (len(path), len(path) - 1) if tuple(path[i - 2:i]) in routed), None)

    expert_bytes = collections.Counter()
    for path, v in flat.items():
        value = v.get_value()
        if weight(path) and not isinstance(value, SplitExperts):
            expert_bytes[weight(path)] += value.nbytes // value.shape[0]
    for path, v in list(flat.items()):
        w = weight(path)
        if w is None or expert_bytes[w] < max(min_bytes, 1):
            continue
        if w[-1] == "w2":
            flat[path] = v.replace(split_experts(v.get_value()))
        elif w[-1] == "w1":  # w1 and w3 share the path but for the weight's name
            up_path = (*w[:-1], "w3", *path[len(w):])
            fused, placeholder = split_gate_up(v.get_value(), flat[up_path].get_value())
            flat[path], flat[up_path] = v.replace(fused), flat[up_path].replace(placeholder)
    return nnx.from_flat_state(list(flat.items()))


def put(value, sharding):
    """Places a value every process holds whole: each device takes its slice from host memory
    (works on a mesh spanning several processes, where device_put of a local array does not)."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def cache_shardings(cache: DecodeState, mesh: Mesh) -> DecodeState:
    return DecodeState(_layer_shardings(cache.layers, CACHE_AXES, mesh),
                       named_sharding(("batch",), cache.lengths.shape, mesh))


def pool_shardings(pools: tuple, mesh: Mesh) -> tuple:
    """Shardings of the engine's cache pools (`decoder.init_pools`)."""
    return _layer_shardings(pools, POOL_AXES, mesh)


def _layer_shardings(layers: tuple, table: dict, mesh: Mesh) -> tuple:
    """Shardings of the per-layer caches, each array's logical axes taken from `table`."""
    return tuple(type(c)(*(named_sharding(a, x.shape, mesh) for a, x in zip(table[type(c)], c))) for c in layers)
