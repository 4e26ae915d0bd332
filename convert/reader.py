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
    """Maps tensor names to files and reads one tensor (or a slice of it) at a time."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        self._files: dict[str, str] = {}  # tensor name -> file path
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map'")
            for name, file in weight_map.items():
                self._files[name] = os.path.join(self.directory, file)
            missing = sorted({p for p in self._files.values() if not os.path.exists(p)})
            if missing:
                raise CheckpointError(f"{index} names shard files that do not exist: {missing[:3]}")
        else:
            shards = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
            if not shards:
                raise CheckpointError(f"no *.safetensors files in {self.directory}")
            for file in shards:
                path = os.path.join(self.directory, file)
                with _open(path) as f:
                    for name in f.keys():
                        self._files[name] = path
        # Published K3 checkpoints may use "language_model.layers.N." for "language_model.model.layers.N.".
        for name in [n for n in self._files if _LAYER_ALIAS.match(n)]:
            canonical = _LAYER_ALIAS.sub("language_model.model.layers.", name)
            self._files.setdefault(canonical, self._files[name])
            del self._files[name]

    def names(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def read(self, name: str) -> np.ndarray:
        path = self._file(name)
        with _open(path) as f:
            stored = self._stored_name(f, name)
            if stored not in f.keys():
                raise CheckpointError(f"{path} does not hold tensor {name!r} although the index says so")
            try:
                return f.get_tensor(stored)
            except Exception as error:  # safetensors raises its own types for truncated data
                raise CheckpointError(f"{path}: cannot read tensor {name!r} ({error})") from error

    def _file(self, name: str) -> str:
        if name not in self._files:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {name!r}")
        return self._files[name]

    @staticmethod
    def _stored_name(handle, name: str) -> str:
        if name in handle.keys():
            return name
        return name.replace("language_model.model.layers.", "language_model.layers.", 1)  # the alias form


def _open(path: str):
    try:
        return safe_open(path, framework="numpy")
    except Exception as error:  # a truncated or corrupt header
        raise CheckpointError(f"{path} is not a readable safetensors file ({error})") from error
