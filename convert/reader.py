"""Lazy reads of a Hugging Face safetensors checkpoint: one file, or shards with an index.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets into the data section), then the data. Tensors are read with plain file reads straight into
their destination array, not through a memory map: mapped pages of a 1.5 TB checkpoint would count
against the process and a copy out of the map would double every read.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import NamedTuple

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
_LAYER_ALIAS = re.compile(r"^language_model\.layers\.")
_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
           "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
           "F8_E8M0": ml_dtypes.float8_e8m0fnu}
_MAX_HEADER = 100 * 2**20  # the format's own limit


class CheckpointError(ValueError):
    """The checkpoint is missing, unreadable or does not match the config; the message names the tensor."""


class _Entry(NamedTuple):
    """Where one tensor lives."""

    path: str
    stored: str  # its name in the file
    offset: int  # of its first byte in the file
    dtype: np.dtype
    shape: tuple[int, ...]


class SafetensorsReader:
    """Maps tensor names to files and reads one tensor at a time (each file's header parsed once)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map'")
            files = sorted({os.path.join(self.directory, file) for file in weight_map.values()})
            missing = [p for p in files if not os.path.exists(p)]
            if missing:
                raise CheckpointError(f"{index} names shard files that do not exist: {missing[:3]}")
        else:
            files = sorted(os.path.join(self.directory, f) for f in os.listdir(self.directory)
                           if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.directory}")
        self._entries: dict[str, _Entry] = {}
        for path in files:
            for entry in _parse_header(path):
                # Published K3 checkpoints may use "language_model.layers.N." for "language_model.model.layers.N.".
                self._entries[_LAYER_ALIAS.sub("language_model.model.layers.", entry.stored)] = entry

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def info(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """(dtype, shape) of the tensor `name`, from the header."""
        entry = self._entry(name)
        return entry.dtype, entry.shape

    def read(self, name: str, out: np.ndarray | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor `name`, or its rows [start, stop) along axis 0. With `out` (that shape, any dtype of
        the same item size, contiguous) the bytes are read into it unchanged: that is how stacked experts
        are filled in place and E8M0 scale bytes are read as uint8."""
        entry = self._entry(name)
        start, stop = rows if rows is not None else (0, entry.shape[0] if entry.shape else 1)
        shape = entry.shape if rows is None else (stop - start, *entry.shape[1:])
        if out is None:
            out = np.empty(shape, entry.dtype)
        elif out.shape != shape or out.dtype.itemsize != entry.dtype.itemsize or not out.flags.c_contiguous:
            raise CheckpointError(f"{entry.path}: tensor {entry.stored!r} is {entry.dtype} {shape}, "
                                  f"cannot be read into a {out.dtype} {out.shape} buffer")
        buffer = memoryview(out.reshape(-1).view(np.uint8))
        with open(entry.path, "rb", buffering=0) as f:
            f.seek(entry.offset + start * entry.dtype.itemsize * math.prod(entry.shape[1:]))
            done = f.readinto(buffer)
        if done != buffer.nbytes:
            raise CheckpointError(f"{entry.path}: tensor {entry.stored!r} is truncated "
                                  f"(read {done} of {buffer.nbytes} bytes)")
        return out

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {name!r}")
        return entry


def _parse_header(path: str) -> list[_Entry]:
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} does not fit the file's {size} bytes")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (struct.error, ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not a readable safetensors file ({error})") from error
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = np.dtype(_DTYPES[info["dtype"]]), tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{path}: tensor {name!r} has an unreadable header entry {info!r}") from error
        if end - start != dtype.itemsize * int(np.prod(shape)):
            raise CheckpointError(f"{path}: tensor {name!r} spans {end - start} bytes, but {info['dtype']} "
                                  f"{list(shape)} needs {dtype.itemsize * int(np.prod(shape))}")
        if 8 + length + end > size:
            raise CheckpointError(f"{path} is truncated: tensor {name!r} ends at byte {8 + length + end}, "
                                  f"the file has {size}")
        entries.append(_Entry(path, name, 8 + length + start, dtype, shape))
    return entries
