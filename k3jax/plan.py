"""Per-device memory of a config on a mesh, from the same logical-axis table the code places arrays by.

    python -m k3jax.plan --preset kimi-k3 --mesh 8x2 [--device-gib 141]

Prints weights per device, MLA cache per 1K tokens and KDA state per sequence per device, and how
many concurrent 8K / 128K / 1M-token sequences fit after the weights: with DP attention, as the engine
runs (each data group holds only its own requests' caches, serve/runner.py), and without (every group
holding every request's, as a mesh's data groups would with the pools replicated). Nothing is allocated: shapes
come from `nnx.eval_shape`, shardings from `sharding.axes`, on an abstract mesh of the right size.
"""

from __future__ import annotations

import argparse
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from k3jax.config import K3Config
from k3jax.decoder import K3Transformer, init_cache
from k3jax.model import resolve_dtype
from k3jax.placement import CACHE_AXES, check_mesh
from sharding.axes import partition_spec
from sharding.mesh import AXES, DATA, MODEL, parse_mesh

GIB = 2**30


def _per_device_bytes(shape, dtype, axes, mesh) -> float:
    spec = partition_spec(axes, tuple(shape), mesh)
    ways = 1
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            ways *= mesh.shape[axis]
    return math.prod(shape) * np.dtype(dtype).itemsize / ways


def plan(cfg: K3Config, mesh_spec: str, *, dtype: str = "bfloat16", device_bytes: float = 141e9) -> dict:
    sizes = parse_mesh(mesh_spec)
    mesh = AbstractMesh((sizes[DATA], sizes[MODEL]), AXES, axis_types=(AxisType.Auto,) * 2)
    check_mesh(cfg, mesh)
    abstract = nnx.eval_shape(lambda: K3Transformer(cfg, dtype=resolve_dtype(dtype)))
    weights = sum(_per_device_bytes(v.get_value().shape, v.get_value().dtype, v.logical_axes, mesh)
                  for _, v in nnx.to_flat_state(nnx.split(abstract)[1]))

    def cache_bytes(tokens: int) -> float:
        """Per-device bytes of one sequence's caches (one sequence per data shard)."""
        cache = jax.eval_shape(lambda: init_cache(cfg, sizes[DATA], tokens, resolve_dtype(dtype)))
        total = 0.0
        for c in cache.layers:
            total += sum(_per_device_bytes(x.shape, x.dtype, a, mesh) for x, a in zip(c, CACHE_AXES[type(c)]))
        return total

    kda_state = cache_bytes(1) - (cache_bytes(2) - cache_bytes(1))  # the length-independent part
    mla_per_1k = cache_bytes(1025) - cache_bytes(1)  # 1024 more tokens
    free = device_bytes - weights
    fits = {}
    for name, tokens in (("8K", 8192), ("128K", 131072), ("1M", 1048576)):
        per_sequence = kda_state + mla_per_1k * tokens / 1024
        fits[f"concurrent_{name}"] = max(0, int(free // per_sequence)) * sizes[DATA]
        fits[f"concurrent_{name}_without_dp_attention"] = max(0, int(free // per_sequence))
    return {"mesh": mesh_spec, "devices": sizes[DATA] * sizes[MODEL], "weights_GiB": weights / GIB,
            "mla_cache_MiB_per_1k_tokens": mla_per_1k / 2**20, "kda_state_MiB_per_sequence": kda_state / 2**20,
            "free_GiB": free / GIB, **fits}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="kimi-k3")
    parser.add_argument("--mesh", default="8x2")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device-gib", type=float, default=141.0, help="memory per device (GB as sold: 1e9)")
    args = parser.parse_args(argv)
    result = plan(K3Config.from_preset(args.preset), args.mesh, dtype=args.dtype, device_bytes=args.device_gib * 1e9)
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key.ljust(width)}  {value:.2f}" if isinstance(value, float) else f"{key.ljust(width)}  {value}")


if __name__ == "__main__":
    main()
