"""How a handoff's arrays travel from the prefill server's device to the decode engine (`--transfer-backend`).

The control messages always go over the prefill server's socket (serve/disagg/frames.py); a transport
moves the bulk: `offer` on the prefill side (what the reply says, and the arrays the reply frame
itself carries), `take` on the decode side. Both sides name the transport in their messages, so a
prefill server serves decode engines of either kind.

- `socket`: the arrays go to the host and ride in the reply frame (any backend; loopback on one
  machine, TCP between machines).
- `jax`: `jax.experimental.transfer`: the prefill server keeps the arrays on its device and the decode
  engine pulls them from the prefill process's transfer server into its own device, without the
  host copies where the backend moves device memory directly. Each process starts one transfer
  server, on first use: a second in one process aborts it (on XLA:CPU at least). On this CPU build
  it works between processes (tests/serve/test_disagg.py pulls a handoff across two); a backend
  without transfer support fails at the decode server's start with TransportError.
"""

from __future__ import annotations

import abc
import secrets
import threading

import jax
import numpy as np

from serve.disagg.frames import spec
from serve.disagg.handoff import Handoff


class TransportError(RuntimeError):
    """The transport cannot run here, or a transfer failed."""


class Transport(abc.ABC):
    name: str

    @abc.abstractmethod
    def offer(self, handoff: Handoff, page_size: int, host: str) -> tuple[dict, list[np.ndarray]]:
        """Prefill side (`host`: the address its server is bound to): (what the reply tells the decode
        side, the arrays that travel in the reply frame). Blocking."""

    @abc.abstractmethod
    def take(self, descriptor: dict, inline: list[np.ndarray], host: str) -> list:
        """Decode side (`host`: the prefill server's): the handoff's arrays (pages, conv, state). Blocking."""


class SocketTransport(Transport):
    name = "socket"

    def offer(self, handoff, page_size, host):
        # the pages' padding to a power of two stays behind: the decode side pads again
        pages = handoff.page_rows(handoff.num_pages(page_size))
        return {}, [np.asarray(pages), np.asarray(handoff.conv), np.asarray(handoff.state)]

    def take(self, descriptor, inline, host):
        return inline


class JaxTransport(Transport):
    name = "jax"
    _server = None  # this process's transfer server
    _connections: dict[str, object] = {}
    _lock = threading.Lock()

    def __init__(self, host: str = "127.0.0.1"):
        self._start(host)

    @classmethod
    def _start(cls, host: str):
        with cls._lock:
            if cls._server is None:
                from jax.experimental import transfer  # noqa: PLC0415 (experimental: only when asked for)

                try:
                    cls._server = transfer.start_transfer_server(jax.local_devices()[0].client, f"{host}:0",
                                                                 [f"{host}:0"])
                except Exception as error:  # noqa: BLE001 (whatever the backend raises: it has no transfer server)
                    raise TransportError(f"jax.experimental.transfer does not run on this backend ("
                                         f"{jax.default_backend()}: {error}); use --transfer-backend socket") from error
            return cls._server

    def offer(self, handoff, page_size, host):
        uuid = secrets.randbits(63)
        server = self._start(host)
        server.await_pull(uuid, list(handoff.arrays))  # as gathered: a device slice would compile per length
        return {"port": int(server.address().rsplit(":", 1)[1]), "uuid": uuid,
                "specs": [[list(a.shape), np.dtype(a.dtype).name] for a in handoff.arrays]}, []

    def take(self, descriptor, inline, host):
        address = f"{host}:{int(descriptor['port'])}"  # a bad descriptor raises here: the caller's error
        with self._lock:
            if address not in self._connections:
                self._connections[address] = self._server.connect(address)
            connection = self._connections[address]
        sharding = jax.sharding.make_single_device_sharding(jax.local_devices()[0])
        specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                 for shape, dtype in map(spec, descriptor["specs"])]
        try:
            return jax.block_until_ready(connection.pull(int(descriptor["uuid"]), specs))
        except jax.errors.JaxRuntimeError as error:
            raise TransportError(f"pulling the handoff from {address} failed: {error}") from error


def make(name: str, host: str = "127.0.0.1") -> Transport:
    """The transport of `--transfer-backend name` (`host`: where its transfer server listens)."""
    if name == "socket":
        return SocketTransport()
    if name == "jax":
        return JaxTransport(host)
    raise TransportError(f"{name!r} is not one of 'socket', 'jax'")
