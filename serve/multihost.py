"""Multi-host serving: process 0 runs the HTTP server, the scheduler and sampling; every other process
holds its share of the model and of the cache pools and runs each device step with it.

Before each step the leader's Runner announces it: an op code and the step's shape, then its arrays,
both through JAX's own collectives (`broadcast_one_to_all`, no side channel). The followers loop in
`Runner.follow`, running the same step on the same arrays, so every process enters the same SPMD
programs in the same order. The logits come back replicated, so the leader samples from its own copy
without the others. This applies when the model's mesh spans processes (`spans_processes`); an
engine on one process's own devices (the eval job runs one per process) announces nothing.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

RUN, COPY_SLOT, STOP = 1, 2, 3


def spans_processes(mesh) -> bool:
    return mesh is not None and mesh.is_multi_process


def is_leader() -> bool:
    return jax.process_index() == 0


def announce(op: int, rows: int = 0, tokens: int = 0, arrays: tuple = ()) -> None:
    """Leader: tells the followers which step comes next, then sends its arrays (int32)."""
    multihost_utils.broadcast_one_to_all(np.array([op, rows, tokens], np.int32))
    if arrays:
        multihost_utils.broadcast_one_to_all(tuple(np.asarray(a, np.int32) for a in arrays))


def receive(shapes_of) -> tuple[int, tuple]:
    """Follower: the next step's op code and arrays. shapes_of(op, rows, tokens) gives the shapes of
    the arrays the leader sends with that op (none: an empty tuple)."""
    op, rows, tokens = (int(x) for x in multihost_utils.broadcast_one_to_all(np.zeros(3, np.int32)))
    shapes = shapes_of(op, rows, tokens)
    if not shapes:
        return op, ()
    placeholders = tuple(np.zeros(shape, np.int32) for shape in shapes)
    return op, tuple(np.asarray(a) for a in multihost_utils.broadcast_one_to_all(placeholders))


def local_copy(x: jax.Array, mesh) -> jax.Array:
    """x replicated on every device of the mesh (every process takes part), then this process's
    first copy: an array the leader can sample from on its own."""
    return _replicate(mesh)(x).addressable_data(0)


@functools.cache
def _replicate(mesh):
    """One jitted identity per mesh, so each step reuses its compilation."""
    return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))
