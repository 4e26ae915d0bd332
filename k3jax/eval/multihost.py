"""The few collectives the eval job needs between processes, over JAX's own multi-controller
runtime (no side channel): integer tables to agree on a batch schedule, and bytes to bring every
process's result lines to process 0 (and process 0's resume state to everyone).

With one process each function returns its input at once, so single-host runs pay nothing.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def process_count() -> int:
    return jax.process_count()


def process_index() -> int:
    return jax.process_index()


def allgather_ints(values) -> np.ndarray:
    """Every process's int64 vector (any lengths) -> [processes, longest] padded with -1."""
    values = np.asarray(values, np.int64).reshape(-1)
    if jax.process_count() == 1:
        return values[None]
    sizes = multihost_utils.process_allgather(np.asarray([values.size], np.int64))
    longest = int(np.max(sizes))
    padded = np.full((max(longest, 1),), -1, np.int64)
    padded[:values.size] = values
    return np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), -1)


def allgather_bytes(payload: bytes) -> list[bytes]:
    """Every process's bytes, in process order."""
    if jax.process_count() == 1:
        return [payload]
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([len(payload)], np.int64))).reshape(-1)
    padded = np.zeros((max(int(sizes.max()), 1),), np.uint8)
    padded[:len(payload)] = np.frombuffer(payload, np.uint8)
    table = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [bytes(row[:n]) for row, n in zip(table, sizes)]


def broadcast_bytes(payload: bytes) -> bytes:
    """Process 0's bytes on every process."""
    return allgather_bytes(payload if jax.process_index() == 0 else b"")[0]


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
