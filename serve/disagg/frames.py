"""The control channel between a decode engine and a prefill server: one message each way per TCP
connection, each a length-prefixed frame of a JSON header and NumPy arrays.

A frame is `!QI` (payload bytes, header bytes), the header (UTF-8 JSON, an object), then the raw bytes
of each array the header's "arrays" entry lists as [shape, dtype name], C order. Nothing is unpickled:
a reader checks the sizes, the dtype names (a fixed list) and that the arrays fill the payload
exactly, and raises FrameError naming what is wrong.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct

import ml_dtypes
import numpy as np

PREFIX = struct.Struct("!QI")
MAX_HEADER_BYTES = 1 << 20
# the dtypes a handoff holds: token ids, fp32 states, activation-dtype conv windows, pages as stored
DTYPES = {name: np.dtype(t) for name, t in (("int32", np.int32), ("float32", np.float32), ("float16", np.float16),
                                            ("bfloat16", ml_dtypes.bfloat16),
                                            ("float8_e4m3fn", ml_dtypes.float8_e4m3fn))}


class FrameError(ValueError):
    """A frame that does not follow the format (or is larger than the reader takes)."""


async def write(writer: asyncio.StreamWriter, header: dict, arrays=()) -> None:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    for a in arrays:
        if a.dtype.name not in DTYPES:
            raise FrameError(f"arrays: dtype {a.dtype.name} is not one of {sorted(DTYPES)}")
    head = json.dumps({**header, "arrays": [[list(a.shape), a.dtype.name] for a in arrays]}).encode()
    writer.write(PREFIX.pack(sum(a.nbytes for a in arrays), len(head)) + head)
    for a in arrays:
        writer.write(a.reshape(-1).view(np.uint8).data)
    await writer.drain()


async def read(reader: asyncio.StreamReader, max_bytes: int) -> tuple[dict, list[np.ndarray]] | None:
    """The next frame's header and arrays (read-only views of the payload); None when the peer closed
    the connection before a frame began."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as error:
        if not error.partial:
            return None
        raise FrameError("the connection closed inside a frame") from None
    size, head_size = PREFIX.unpack(prefix)
    if head_size > MAX_HEADER_BYTES or size > max_bytes:
        raise FrameError(f"a frame of {head_size} header and {size} payload bytes; this side takes at most "
                         f"{MAX_HEADER_BYTES} and {max_bytes}")
    try:
        header = json.loads(await reader.readexactly(head_size))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FrameError(f"the header is not JSON: {error}") from None
    except asyncio.IncompleteReadError:
        raise FrameError("the connection closed inside a frame") from None
    specs = header.pop("arrays", None) if isinstance(header, dict) else None
    if not isinstance(specs, list):
        raise FrameError("the header is not an object with an 'arrays' list")
    shapes = [spec(entry) for entry in specs]
    if sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes) != size:
        raise FrameError(f"the arrays {specs} do not fill the frame's {size} payload bytes")
    try:
        payload = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise FrameError("the connection closed inside a frame") from None
    arrays, offset = [], 0
    for shape, dtype in shapes:
        count = math.prod(shape)
        arrays.append(np.frombuffer(payload, dtype, count, offset).reshape(shape))
        offset += count * dtype.itemsize
    return header, arrays


def spec(entry) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a JSON [shape, dtype name] (FrameError when it is not one)."""
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and entry[1] in DTYPES
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry[0])):
        raise FrameError(f"an array spec {entry!r} is not [shape, dtype] with a dtype of {sorted(DTYPES)}")
    return tuple(entry[0]), DTYPES[entry[1]]
