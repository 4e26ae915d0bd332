"""Converted checkpoints: parameters in the model's layout as Orbax items, one per decoder layer.

    OUT/config.json, tokenizer files, manifest.json
    OUT/params/model        embedding, final norms, LM head
    OUT/params/layer_00000  decoder layer 0 (MXFP4 experts packed), ...

One item per layer keeps conversion streaming (one layer in host memory) and lets a restore read
each layer straight into its device shards.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp

from convert.reader import CheckpointError
from k3jax.config import K3Config

PARAMS_DIR = "params"
MANIFEST = "manifest.json"


def item_name(layer: int | None) -> str:
    return "model" if layer is None else f"layer_{layer:05d}"


def is_converted(directory) -> bool:
    return os.path.exists(os.path.join(directory, MANIFEST)) and os.path.isdir(os.path.join(directory, PARAMS_DIR))


def key(path: tuple) -> str:
    return "/".join(map(str, path))


class OrbaxParams:
    """Same interface as HfParams (`model()`, `layer(i)`, `check_unused()`), from a converted directory.

    `shardings` (optional, parameter path -> sharding) are what each array is restored into, so every
    device reads only its own slice from storage.
    """

    def __init__(self, directory, cfg: K3Config):
        self.directory = os.fspath(directory)
        self.cfg = cfg
        with open(os.path.join(self.directory, MANIFEST)) as f:
            self.manifest = json.load(f)
        self._checkpointer = ocp.StandardCheckpointer()

    def model(self, shardings: dict | None = None) -> dict[tuple, jax.Array]:
        return self._restore(None, shardings or {})

    def layer(self, index: int, shardings: dict | None = None) -> dict[tuple, jax.Array]:
        return self._restore(index, shardings or {})

    def check_unused(self) -> None:
        """Nothing to check: the converter wrote exactly the parameters (the manifest lists them)."""

    def _restore(self, layer: int | None, shardings: dict) -> dict[tuple, jax.Array]:
        name = item_name(layer)
        entries = self.manifest["items"].get(name)
        if entries is None:
            raise CheckpointError(f"{self.directory}: manifest has no item {name!r}")
        target = {}
        for k, entry in entries.items():
            shape = tuple(entry["shape"])
            target[k] = jax.ShapeDtypeStruct(shape, entry["dtype"], sharding=shardings.get(tuple(k.split("/"))))
        path = os.path.join(self.directory, PARAMS_DIR, name)
        try:
            restored = self._checkpointer.restore(path, target)
        except Exception as error:  # orbax raises many types; name the item that failed
            raise CheckpointError(f"{path}: cannot restore ({type(error).__name__}: {error})") from error
        return {tuple(k.split("/")): v for k, v in restored.items()}


def save_item(directory: str, layer: int | None, arrays: dict[tuple, object], checkpointer) -> None:
    checkpointer.save(os.path.join(directory, PARAMS_DIR, item_name(layer)), {key(p): a for p, a in arrays.items()})
