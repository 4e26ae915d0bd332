"""Lazy reads of a Hugging Face safetensors checkpoint: one file, or shards with an index."""

from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np
from safetensors import safe_open

# safetensors' numpy backend looks these names up on numpy itself.
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "bfloat16"):
    if not hasattr(np, _name):
        setattr(np, _name, getattr(ml_dtypes, _name))

INDEX_FILE = "model.safetensors.index.json"
_LAYER_ALIAS = re.compile(r"^language_model\.layers\.")


class CheckpointError(ValueError):
    """The checkpoint is missing, unreadable or does not match the config; the message names the tensor."""


class SafetensorsReader:
    """Maps tensor names to files and reads one tensor at a time (each file's header parsed once)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        self._files: dict[str, tuple[str, str]] = {}  # canonical name -> (file path, name as stored)
        self._handles: dict[str, object] = {}  # file path -> open safetensors handle
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map'")
            stored = {name: os.path.join(self.directory, file) for name, file in weight_map.items()}
            missing = sorted({p for p in stored.values() if not os.path.exists(p)})
            if missing:
                raise CheckpointError(f"{index} names shard files that do not exist: {missing[:3]}")
        else:
            shards = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
            if not shards:
                raise CheckpointError(f"no *.safetensors files in {self.directory}")
            stored = {}
            for file in shards:
                path = os.path.join(self.directory, file)
                stored.update({name: path for name in self._handle(path).keys()})
        # Published K3 checkpoints may use "language_model.layers.N." for "language_model.model.layers.N.".
        for name, path in stored.items():
            self._files[_LAYER_ALIAS.sub("language_model.model.layers.", name)] = (path, name)

    def names(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def read(self, name: str) -> np.ndarray:
        if name not in self._files:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {name!r}")
        path, stored = self._files[name]
        try:
            return self._handle(path).get_tensor(stored)
        except CheckpointError:
            raise
        except Exception as error:  # safetensors raises its own types for missing or truncated data
            raise CheckpointError(f"{path}: cannot read tensor {stored!r} ({error})") from error

    def release(self) -> None:
        """Closes the open files: their mapped pages stop counting against this process's memory."""
        self._handles.clear()

    def _handle(self, path: str):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="numpy")
            except Exception as error:  # a truncated or corrupt header
                raise CheckpointError(f"{path} is not a readable safetensors file ({error})") from error
        return self._handles[path]
