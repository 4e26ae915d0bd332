"""Multi-host start-up: one `jax.distributed.initialize` at the entry point, when asked for.

Entry points add `--coordinator`, `--num-processes` and `--process-id`; the environment variables
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID work too. JAX's own multi-controller
runtime is the distributed engine: every process runs the same program on its local devices.
"""

from __future__ import annotations

import argparse
import os

import jax


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-host")
    group.add_argument("--coordinator", help="host:port of process 0 (JAX_COORDINATOR_ADDRESS)")
    group.add_argument("--num-processes", type=int, help="processes in the job (JAX_NUM_PROCESSES)")
    group.add_argument("--process-id", type=int, help="this process's index (JAX_PROCESS_ID)")


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, timeout_s: int = 300) -> bool:
    """Starts the distributed runtime when a coordinator is given (argument or environment);
    returns whether it did. Single-process runs need nothing."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not coordinator:
        return False
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if num_processes is None or process_id is None:
        raise ValueError("a coordinator needs --num-processes and --process-id (or JAX_NUM_PROCESSES and "
                         "JAX_PROCESS_ID)")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} is outside 0..{num_processes - 1}")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=timeout_s)
    return True


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None
