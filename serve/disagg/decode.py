"""The decode server's side (`python -m k3jax.serve --role decode --prefill-url HOST:PORT`).

Clients send their requests (completions, chat, Messages, Responses) to the decode server as to any
server. vLLM and SGLang put a proxy or router in front that sends each request to a prefill instance
and a decode instance; here the decode server is that router: one address for clients, no third
process. For every prompt of a request (one per distinct prompt, whatever `n`) `DecodeEngine.submit`
asks the prefill server for the cache of all but its last token (`PrefillClient.prefill`, the
event loop waiting on the socket, a worker thread on the transport), checks it against its own pools,
and submits the request to the engine with the `Prefilled` prompt; the engine computes the last
token and samples every output token as if it had prefilled the prompt itself. A one-token prompt is
computed here. Prompts with images are refused (the prefill server would need them).

A prefill that fails is the request's `PrefillError`: a 503 (Retry-After) when the prefill server is
unreachable or full, a 502 naming what is wrong otherwise (the engines differ, a bad answer); the
server goes on. A client that leaves closes the connection, which aborts the prefill there.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import numpy as np

from serve.async_engine import AsyncEngine, RequestGroup
from serve.disagg import frames, transport
from serve.disagg.handoff import Handoff, Prefilled, check_handoff, fingerprint, pool_specs
from serve.multimodal import MultimodalPrompt

logger = logging.getLogger(__name__)

MAX_HANDOFF_BYTES = 1 << 40  # the prefill server is trusted to send what it holds


class PrefillError(Exception):
    """A prompt the prefill server did not prefill; `status` is the HTTP status it becomes."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" (a scheme such as tcp:// is allowed and ignored)."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--prefill-url: {address!r} is not HOST:PORT")
    return host, int(port)


class PrefillClient:
    def __init__(self, address: str, engine, transport_name: str = "socket", bind_host: str = "127.0.0.1"):
        """address: the prefill server's HOST:PORT (its --transfer-port); engine: this side's
        serve.engine.Engine; bind_host: where a jax transport's transfer server listens."""
        self.address = address
        self.host, self.port = parse_address(address)
        self.fingerprint = fingerprint(engine)
        self.specs = pool_specs(engine.runner.pools)
        self.page_size = engine.layout.page_size
        self.transport = transport.make(transport_name, bind_host)

    async def hello(self) -> None:
        """Raises PrefillError unless the prefill server answers and its engine matches this one."""
        await self._exchange({"type": "hello"}, [])

    async def prefill(self, ids: list[int]) -> Prefilled:
        """The prompt `ids` (2 tokens or more) with the cache of all but its last token."""
        request_id = secrets.token_hex(8)
        header, arrays = await self._exchange({"type": "prefill", "id": request_id, "transport": self.transport.name},
                                              [np.asarray(ids, np.int32)])
        if header.get("type") != "handoff" or header.get("id") != request_id:
            raise PrefillError(f"the prefill server answered {header.get('type')!r} for request "
                               f"{header.get('id')!r}, not a handoff for {request_id!r}")
        try:
            arrays = await asyncio.to_thread(self.transport.take, header["transport"], arrays, self.host)
            prefilled = Prefilled(ids, Handoff(int(header["num_tokens"]), *arrays))
            check_handoff(prefilled.handoff, ids, self.specs, self.page_size)
        except (KeyError, TypeError, ValueError, transport.TransportError) as error:
            raise PrefillError(f"the prefill server's handoff is unusable: {error}") from error
        return prefilled

    async def _exchange(self, header: dict, arrays: list) -> tuple[dict, list[np.ndarray]]:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as error:
            logger.warning("the prefill server at %s is unreachable: %s", self.address, error)
            raise PrefillError("the prefill server is unreachable; retry later", 503) from None
        try:  # a cancelled request (its client left) closes the connection, which aborts the prefill
            await frames.write(writer, {**header, "fingerprint": self.fingerprint}, arrays)
            reply = await frames.read(reader, MAX_HANDOFF_BYTES)
        except (OSError, frames.FrameError) as error:
            logger.warning("the connection to the prefill server at %s failed: %s", self.address, error)
            raise PrefillError("the connection to the prefill server failed; retry later", 503) from None
        finally:
            writer.close()
        if reply is None:
            raise PrefillError("the prefill server closed the connection without an answer; retry later", 503)
        if reply[0].get("type") == "error":
            message = reply[0].get("message")
            raise PrefillError(f"the prefill server refused: {message}", 503 if reply[0].get("retry") else 502)
        return reply


class DecodeEngine(AsyncEngine):
    """An AsyncEngine whose requests' prompts the prefill server computes first."""

    def __init__(self, engine, prefill: PrefillClient, **kwargs):
        super().__init__(engine, **kwargs)
        self.prefill = prefill

    async def submit(self, requests) -> RequestGroup:
        if any(isinstance(prompt, MultimodalPrompt) for prompt, _ in requests):
            raise ValueError("prompt: a disaggregated decode server takes no images")
        distinct = list(dict.fromkeys(tuple(p) for p, _ in requests if isinstance(p, list) and len(p) > 1))
        tasks = [asyncio.ensure_future(self.prefill.prefill(list(prompt))) for prompt in distinct]
        try:
            prefilled = dict(zip(distinct, await asyncio.gather(*tasks)))
        except BaseException:  # one failed or the request was cancelled: the others' prefills are not needed
            for task in tasks:
                task.cancel()
            raise
        return await super().submit([(prefilled.get(tuple(p), p) if isinstance(p, list) else p, params)
                                     for p, params in requests])
