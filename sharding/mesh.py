"""Device meshes from `--mesh` strings: "AxB" is A-way `model` by B-way `data` (ARCHITECTURE.md, "Meshes").

`model` is the fast axis: consecutive devices (one node's GPUs) share a model-parallel group.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

# The mesh axes, named here only: requests and batch rows split over DATA; heads, widths and (with
# DATA) experts over MODEL.
DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)


def parse_mesh(spec: str) -> dict[str, int]:
    """"8x2" or "model=8,data=2" -> {"model": 8, "data": 2}."""
    spec = spec.strip()
    if m := re.fullmatch(r"(\d+)x(\d+)", spec):
        sizes = {MODEL: int(m.group(1)), DATA: int(m.group(2))}
    else:
        sizes = {}
        for part in spec.split(","):
            m = re.fullmatch(r"\s*(model|data)\s*=\s*(\d+)\s*", part)
            if not m or m.group(1) in sizes:
                raise ValueError(f"mesh {spec!r} is not 'AxB' (model x data) or 'model=A,data=B'")
            sizes[m.group(1)] = int(m.group(2))
        sizes = {MODEL: sizes.get(MODEL, 1), DATA: sizes.get(DATA, 1)}
    if min(sizes.values()) < 1:
        raise ValueError(f"mesh {spec!r} has an axis of size 0")
    return sizes


def make_mesh(spec: str, devices=None) -> Mesh:
    sizes = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    needed = sizes[MODEL] * sizes[DATA]
    if needed > len(devices):
        raise ValueError(f"mesh {spec} needs {needed} devices, found {len(devices)}")
    grid = np.asarray(devices[:needed]).reshape(sizes[DATA], sizes[MODEL])
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)


def as_mesh(mesh: Mesh | str | None) -> Mesh | None:
    """None (one device), a Mesh, or a `--mesh` string made into one."""
    return make_mesh(mesh) if isinstance(mesh, str) else mesh


def data_size(mesh: Mesh | None) -> int:
    """How many ways batch rows split: row counts must be multiples of it."""
    return 1 if mesh is None else mesh.shape[DATA]


def rows_sharding(mesh: Mesh) -> NamedSharding:
    """Arrays whose leading dimension is batch rows, split over DATA."""
    return NamedSharding(mesh, PartitionSpec(DATA))
