"""Lowering a jitted function for a GPU that is not here: the CPU-side check that a Pallas-Triton kernel
really lowers to Triton IR (block shapes, dot sizes, supported primitives), not only that it interprets.

Pallas-Triton asks `get_gpu_info()` for the target; an abstract mesh whose abstract device names the GPU
answers it without a GPU. XLA's Triton compilation (PTX, register use) still only happens on a GPU.
"""

from __future__ import annotations

import jax
from jax._src.mesh import AbstractDevice, AbstractMesh

# (device kind, platform): an NVIDIA Hopper and an AMD MI300 target.
TARGETS = {"cuda": ("NVIDIA H200", "gpu"), "rocm": ("gfx942", "gpu")}


def lower_for_gpu(fn, *args, platform: str = "cuda", **kwargs) -> str:
    """Traces fn(*args, **kwargs) (args may be jax.ShapeDtypeStruct) and lowers it for `platform`;
    returns the StableHLO text, in which each Pallas kernel is a Triton custom call."""
    kind, device_platform = TARGETS[platform]
    mesh = AbstractMesh((1,), ("gpu",), abstract_device=AbstractDevice(kind, None, device_platform))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=(platform,)).as_text()


def triton_call_count(hlo_text: str) -> int:
    return hlo_text.count("__gpu$xla.gpu.triton")
