"""Expert-parallel routed experts with `shard_map` and collectives XLA:CPU implements.

Routed experts are split over every device (`data` x `model`). Tokens are sharded over `data` and
replicated over `model`. Each device gathers the tokens of every data shard (`all_gather` over
`data`), runs only the (token, expert) pairs whose expert it holds, and the partial outputs are
summed back to the tokens' owners (`psum_scatter` over `data`, `psum` over `model`). No capacity limit: every routed pair is computed, so no token is dropped. This is the
all-gather / reduce-scatter form (tpu-inference's GMM_EP): more bytes moved than an all-to-all, but
simple, exact and available on every backend (`ragged_all_to_all` is not on XLA:CPU).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from sharding.mesh import DATA, MODEL

EXPERT_AXES = (DATA, MODEL)


def context_mesh():
    """The mesh set with `jax.set_mesh` around the current trace, or None without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def expert_parallel_moe(grouped_ffn: Callable, x, topk_ids, topk_weights, expert_weights, *, mesh: Mesh):
    """Routed-expert output float32 [T, D] for x [T, D] (T sharded over `data`).

    grouped_ffn(rows [M, D], group_sizes [E_local], *weights) -> [M, D] is the local grouped FFN over
    rows sorted by local expert (rows past sum(group_sizes) give zeros); expert_weights is a tuple
    of pytrees whose leaves carry the expert axis first.
    """
    num_experts = jax.tree.leaves(expert_weights)[0].shape[0]
    devices = mesh.shape[DATA] * mesh.shape[MODEL]
    if num_experts % devices:
        raise ValueError(f"{num_experts} experts do not divide over the {devices} devices of the mesh")
    local_experts = num_experts // devices

    def body(x, ids, weights, *local_weights):
        x_all = jax.lax.all_gather(x, DATA, axis=0, tiled=True)
        ids_all = jax.lax.all_gather(ids, DATA, axis=0, tiled=True)
        weights_all = jax.lax.all_gather(weights, DATA, axis=0, tiled=True)
        device = jax.lax.axis_index(DATA) * mesh.shape[MODEL] + jax.lax.axis_index(MODEL)
        local = ids_all - device * local_experts
        mine = (local >= 0) & (local < local_experts)
        t, k = ids_all.shape
        bucket = jnp.where(mine, local, local_experts).reshape(-1)  # other devices' pairs sort last
        order = jnp.argsort(bucket, stable=True)
        sizes = jnp.bincount(bucket, length=local_experts + 1)[:local_experts].astype(jnp.int32)
        y_sorted = grouped_ffn(x_all[order // k], sizes, *local_weights).astype(jnp.float32)
        y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)
        partial = jnp.einsum("tk,tkd->td", jnp.where(mine, weights_all, 0.0).astype(jnp.float32), y)
        mine_tokens = jax.lax.psum_scatter(partial, DATA, scatter_dimension=0, tiled=True)
        return jax.lax.psum(mine_tokens, MODEL)

    weight_specs = jax.tree.map(lambda _: P(EXPERT_AXES), expert_weights)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(DATA), P(DATA), P(DATA), *weight_specs),
                       out_specs=P(DATA), check_vma=False)
    return fn(x, topk_ids, topk_weights, *expert_weights)
