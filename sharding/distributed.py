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
    # No Python stack frames in the programs' source locations: every process must compile the same HLO
    # for a program that spans processes, and by default JAX records in each op's metadata the Python
    # call stack it was traced under, which differs between processes that enter the same program
    # from different code (the serving leader's Runner.run and announce, a follower's Runner.follow
    # and receive). With jax 0.12.1 on CPU (gloo), two processes whose programs differ only in those
    # frames wait forever in their first all-reduce (0.12.0 ran them). Locations keep the op names
    # (the jit and named-scope stack); only the frames go.
    jax.config.update("jax_traceback_in_locations_limit", 0)
    return True


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None
