"""Multi-host serving: process 0 runs the HTTP server, the scheduler and sampling; every other process
holds its share of the model and of the cache pools and runs each device step with it.

Before each step the leader announces it (the Runner for the target's steps, the DSpark speculator
for the draft's): an op code and its host arrays' shapes, then the arrays, all through JAX's own
collectives (`broadcast_one_to_all`, no side channel). The followers loop in `Runner.follow`,
running the same step on the same arrays, so every process enters the same SPMD programs in the
same order. Logits and drafts come back replicated, so the leader samples, accepts and schedules
from its own copies; what it decides (accepted counts, the next rows) reaches the followers as the
arrays of later announcements. This applies when the model's mesh spans processes
(`spans_processes`); an engine on one process's own devices (the eval job runs one per process)
announces nothing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.placement import put

# The steps a leader announces: the target's (Runner) and the DSpark draft's (DSparkSpeculator).
RUN, VERIFY, COMMIT, COPY_SLOT, OBSERVE, PROPOSE, STOP = range(1, 8)
_DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint32), np.dtype(bool))
_HEADER = 64  # int32s: the op, the array count, then each array's dtype code, rank and dims


def spans_processes(mesh) -> bool:
    return mesh is not None and mesh.is_multi_process


def is_leader() -> bool:
    return jax.process_index() == 0


def announce(op: int, *arrays) -> None:
    """Leader: tells the followers which step comes next, with its host arrays (int32, float32,
    uint32 or bool): a header with their dtypes and shapes, then the arrays as int32 bits."""
    arrays = [np.asarray(a) for a in arrays]
    header = [op, len(arrays)]
    for a in arrays:
        if a.dtype not in _DTYPES:
            raise TypeError(f"step {op}: a {a.dtype} array cannot be announced; use one of {[str(d) for d in _DTYPES]}")
        header += [_DTYPES.index(a.dtype), a.ndim, *a.shape]
    if len(header) > _HEADER:
        raise ValueError(f"step {op}: {len(arrays)} arrays of these ranks do not fit the {_HEADER}-int header")
    multihost_utils.broadcast_one_to_all(np.array(header + [0] * (_HEADER - len(header)), np.int32))
    if arrays:
        multihost_utils.broadcast_one_to_all(tuple(a.astype(np.int32) if a.dtype == bool else a.view(np.int32)
                                                   for a in arrays))


def receive() -> tuple[int, tuple[np.ndarray, ...]]:
    """Follower: the next step's op code and arrays, as the leader announced them."""
    header = multihost_utils.broadcast_one_to_all(np.zeros(_HEADER, np.int32)).tolist()
    op, count, at, specs = header[0], header[1], 2, []
    for _ in range(count):
        dtype, rank = _DTYPES[header[at]], header[at + 1]
        specs.append((dtype, tuple(header[at + 2:at + 2 + rank])))
        at += 2 + rank
    if not specs:
        return op, ()
    bits = multihost_utils.broadcast_one_to_all(tuple(np.zeros(shape, np.int32) for _, shape in specs))
    return op, tuple(np.asarray(a).astype(bool) if dtype == bool else np.asarray(a).view(dtype)
                     for a, (dtype, _) in zip(bits, specs))


def replicated(value, mesh):
    """A host array as a jit argument beside arrays on `mesh`: placed whole on every device when the
    mesh spans processes (an array on one local device is not a valid argument there)."""
    if not spans_processes(mesh):
        return jnp.asarray(value)
    return put(value, NamedSharding(mesh, PartitionSpec()))


def local_copy(x: jax.Array, mesh) -> jax.Array:
    """x replicated on every device of the mesh (every process takes part), then this process's
    first copy: an array the leader can sample from on its own."""
    return _replicate(mesh)(x).addressable_data(0)


@functools.cache
def _replicate(mesh):
    """One jitted identity per mesh, so each step reuses its compilation."""
    return jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, PartitionSpec()))
