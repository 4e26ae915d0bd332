"""Device meshes from `--mesh` strings: "AxB" is A-way `model` by B-way `data` (ARCHITECTURE.md, "Meshes").

`model` is the fast axis: consecutive devices (one node's GPUs) share a model-parallel group.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "model")


def parse_mesh(spec: str) -> dict[str, int]:
    """"8x2" or "model=8,data=2" -> {"model": 8, "data": 2}."""
    spec = spec.strip()
    if m := re.fullmatch(r"(\d+)x(\d+)", spec):
        sizes = {"model": int(m.group(1)), "data": int(m.group(2))}
    else:
        sizes = {}
        for part in spec.split(","):
            m = re.fullmatch(r"\s*(model|data)\s*=\s*(\d+)\s*", part)
            if not m or m.group(1) in sizes:
                raise ValueError(f"mesh {spec!r} is not 'AxB' (model x data) or 'model=A,data=B'")
            sizes[m.group(1)] = int(m.group(2))
        sizes = {"model": sizes.get("model", 1), "data": sizes.get("data", 1)}
    if min(sizes.values()) < 1:
        raise ValueError(f"mesh {spec!r} has an axis of size 0")
    return sizes


def make_mesh(spec: str, devices=None) -> Mesh:
    sizes = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    needed = sizes["model"] * sizes["data"]
    if needed > len(devices):
        raise ValueError(f"mesh {spec} needs {needed} devices, found {len(devices)}")
    grid = np.asarray(devices[:needed]).reshape(sizes["data"], sizes["model"])
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)
