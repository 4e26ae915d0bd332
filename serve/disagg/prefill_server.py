"""The prefill server's listener (`python -m k3jax.serve --role prefill`), beside its HTTP API.

Decode servers connect to `--transfer-port`; each connection carries one message and its answer
(frames of serve/disagg/frames.py):

- `{"type": "hello", "fingerprint"}` -> `{"type": "hello"}`: a decode server's start-up check;
- `{"type": "prefill", "id", "fingerprint", "transport"}` with the prompt's ids (int32 [tokens], at
  least 2) -> `{"type": "handoff", "id", "num_tokens", "transport": descriptor}` with the arrays the
  transport puts in the frame (serve/disagg/transport.py).

Instead of its answer a message may get `{"type": "error", "id", "message", "retry"}` naming what is
wrong: fingerprints that differ (each field: serve/disagg/handoff.py), an unknown type or transport,
a malformed frame, a prompt the engine refuses; `retry` when the server is full. A bad message fails
its own connection only.

All but the prompt's last token run as an engine request with `PrefillOnly` params, through the same
AsyncEngine as the HTTP routes: it queues, is chunked and batched with them, may hit the prefix
cache, and its cache comes back on its final output. A decode side that closes the connection
before the answer aborts the request. The listener has an event loop of its own on a daemon thread.
Like SGLang's bootstrap port, the port takes prompts without an API key: only decode servers should
reach it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import numpy as np

from serve.async_engine import AsyncEngine, EngineDead, QueueFull, RequestFailed
from serve.disagg import frames, transport
from serve.disagg.handoff import PrefillOnly, differences, fingerprint

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # a prompt of 16M token ids


class Refused(ValueError):
    """A message the server answers with an error (retry: it may succeed later)."""

    def __init__(self, message: str, retry: bool = False):
        super().__init__(message)
        self.retry = retry


class PrefillServer:
    def __init__(self, engine: AsyncEngine, host: str, port: int):
        """Binds (host, port) now (port 0 picks one: `address` says which); `start` serves it."""
        self.engine = engine
        self.host = host
        self.fingerprint = fingerprint(engine.engine)
        self.page_size = engine.engine.layout.page_size
        self.socket = socket.create_server((host, port))
        self.address = "%s:%d" % self.socket.getsockname()[:2]
        self._transports: dict[str, transport.Transport] = {}

    def start(self) -> None:
        threading.Thread(target=asyncio.run, args=(self._serve(),), name="prefill-server", daemon=True).start()

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._handle, sock=self.socket)
        async with server:
            await server.serve_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request_id = None
        try:
            message = await frames.read(reader, MAX_MESSAGE_BYTES)
            if message is None:
                return
            header, arrays = message
            request_id = header.get("id")
            answer = await self._answer(header, arrays, reader)
            if answer is not None:
                await frames.write(writer, *answer)
        except (Refused, frames.FrameError) as error:
            logger.warning("refused a decode server's message: %s", error)
            await _error(writer, request_id, str(error), getattr(error, "retry", False))
        except ConnectionError:
            pass  # the decode side left
        except Exception:
            logger.exception("answering a decode server failed")
            await _error(writer, request_id, "internal error; see the prefill server's log", False)
        finally:
            writer.close()

    async def _answer(self, header: dict, arrays: list[np.ndarray], reader) -> tuple[dict, list] | None:
        kind = header.get("type")
        if kind not in ("hello", "prefill"):
            raise Refused(f"type: {kind!r} is not 'hello' or 'prefill'")
        if wrong := differences(self.fingerprint, header.get("fingerprint"), "prefill", "decode"):
            raise Refused("the prefill and decode engines differ: " + "; ".join(wrong))
        if kind == "hello":
            return {"type": "hello"}, []
        carrier = self._transport(header.get("transport"))
        if len(arrays) != 1 or arrays[0].dtype != np.int32 or arrays[0].ndim != 1 or len(arrays[0]) < 2:
            raise Refused("prompt: a prefill message carries the prompt's ids, int32 [tokens], at least 2 tokens")
        output = await self._prefill(arrays[0][:-1].tolist(), reader)
        if output is None:
            return None
        descriptor, inline = await asyncio.to_thread(carrier.offer, output.handoff, self.page_size, self.host)
        return {"type": "handoff", "id": header.get("id"), "num_tokens": output.handoff.num_tokens,
                "transport": descriptor}, inline

    def _transport(self, name) -> transport.Transport:
        if name not in self._transports:
            try:
                self._transports[name] = transport.make(name, self.host)
            except transport.TransportError as error:
                raise Refused(f"transport: {error}") from None
        return self._transports[name]

    async def _prefill(self, ids: list[int], reader: asyncio.StreamReader):
        """The engine's final output of the prefill of `ids`; None when the decode side left first."""
        try:
            group = await self.engine.submit([(ids, PrefillOnly())])
        except QueueFull as error:
            raise Refused(str(error), retry=True) from None
        except (ValueError, EngineDead) as error:
            raise Refused(str(error)) from None
        done = asyncio.ensure_future(_final(group))
        left = asyncio.ensure_future(reader.read(1))  # the decode side sends nothing more: any return is its leaving
        try:
            await asyncio.wait((done, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not done.done():
                done.cancel()
                group.abort()
        return done.result() if done.done() and not done.cancelled() else None


async def _final(group):
    try:
        async for _, output in group:
            if output.finished:
                if output.finish_reason != "prefilled":
                    raise Refused(f"the prefill ended with finish_reason {output.finish_reason!r}")
                return output
    except RequestFailed as error:
        raise Refused(f"the prefill failed: {error}") from None


async def _error(writer: asyncio.StreamWriter, request_id, message: str, retry: bool) -> None:
    try:
        await frames.write(writer, {"type": "error", "id": request_id, "message": message, "retry": retry})
    except ConnectionError:
        pass
