"""Shared by the tests that start several JAX processes (jax.distributed over gloo on this host)."""

import socket


def local_coordinator() -> str:
    """host:port of a free local port for process 0's coordination service."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
