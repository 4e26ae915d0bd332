"""The one logical-axis table: every logical axis name a parameter or cache declares, and the mesh
axes it is split over (ARCHITECTURE.md, "Meshes"). Model code names only logical axes.

K3 on `--mesh 8x2` (DEP): attention heads, the dense MLP, shared experts and the vocabulary split
over `model`; routed experts over all devices (`data` x `model`, 896 / 16 = 56 each); norms, AttnRes
and low-rank projections replicated; requests over `data`.
"""

from __future__ import annotations

import math

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import DATA, MODEL

LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    # parameters
    "vocab": (MODEL,),
    "embed": (),
    "heads": (MODEL,),  # MLA head-major dims (q_b, kv_b, g_proj, o_proj)
    "kda_heads": (MODEL,),  # KDA head-major projection width
    "kda_head_count": (MODEL,),  # one entry per KDA head (b_proj, A_log)
    "kda_rank": (),
    "conv_tap": (),
    "q_lora": (),
    "kv_lora": (),
    "kv_latent": (),
    "mlp": (MODEL,),  # dense MLP and shared experts
    "latent": (MODEL,),  # LatentMoE down/up projections: 92 x 2 x 7168 x 3584 would be 9.4 GB replicated
    "experts": (DATA, MODEL),  # routed experts: expert parallel over every device
    "experts_replicated": (),  # the router scores every expert on every device
    "expert_mlp": (),
    "expert_embed": (),
    "norm": (),
    "vision": (),  # the vision tower runs data-parallel: its 12 heads divide neither 8 nor 16 ways
    # caches and activations
    "batch": (DATA,),
    "cache_heads": (MODEL,),  # KDA recurrent state by head
    "qkv": (),  # KDA conv window: which of q, k, v
    "cache_channels": (MODEL,),  # KDA conv window: head-major channels, split like the heads
    "head_dim": (),
    "sequence": (),
    "cache_width": (),  # MLA latent + shared key, shared by all heads
    "slots": (DATA,),  # the engine's KDA state pool: each data group holds its own requests' (DP attention)
    "pages": (DATA,),  # the engine's MLA page pool, split like the slots
    "page_rows": (),
}


def partition_spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axes; a mesh that does not divide a split
    dimension is an error naming both."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    spec = []
    for name, size in zip(axes, shape):
        if name not in LOGICAL_AXES:
            raise ValueError(f"logical axis {name!r} is not in the sharding table")
        mesh_axes = tuple(a for a in LOGICAL_AXES[name] if mesh.shape.get(a, 1) > 1)
        ways = math.prod(mesh.shape[a] for a in mesh_axes)
        if size % ways:
            raise ValueError(f"dimension {name!r} of size {size} does not divide over "
                             f"{' x '.join(f'{a}={mesh.shape[a]}' for a in mesh_axes)}")
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
    return PartitionSpec(*spec)


def named_sharding(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(axes, shape, mesh))
