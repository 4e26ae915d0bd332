"""Converted checkpoints: parameters in the model's layout as Orbax items, one per decoder layer.

    OUT/config.json, tokenizer files, manifest.json
    OUT/params/model.embed_tokens, model.lm_head.kernel, ...   one item per model-level tensor
    OUT/params/layer_00000                                     decoder layer 0 (MXFP4 experts packed), ...
    OUT/params/vision                                          the vision tower and projector, if any

One item per layer keeps conversion streaming (one layer in host memory) and lets a restore read
each layer straight into its device shards. The model-level tensors get an item each because the
embedding and LM head are each as large as a layer.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from convert.reader import CheckpointError
from k3jax.config import K3Config

PARAMS_DIR = "params"
MANIFEST = "manifest.json"
FORMAT = "k3jax-orbax-v3"  # v2: uncompressed items, one item per model-level tensor; v3: Linear kernels [out, in]


VISION_ITEM = "vision"  # the vision tower and projector, one item (K3's: 0.4B parameters)


def layer_item(layer: int) -> str:
    return f"layer_{layer:05d}"


def model_item(path: tuple) -> str:
    return "model." + ".".join(map(str, path))


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
        if self.manifest.get("format") != FORMAT:
            raise CheckpointError(f"{self.directory} was converted to format {self.manifest.get('format')!r}; this "
                                  f"k3jax reads {FORMAT!r}: run python -m convert on the source checkpoint again")
        self._checkpointer = ocp.StandardCheckpointer()

    def model(self, shardings: dict | None = None) -> dict[tuple, jax.Array]:
        arrays = {}
        for name in self.manifest["items"]:
            if name.startswith("model."):
                arrays.update(self.restore(name, shardings or {}))
        return arrays

    def layer(self, index: int, shardings: dict | None = None) -> dict[tuple, jax.Array]:
        return self.restore(layer_item(index), shardings or {})

    def vision(self) -> dict[tuple, jax.Array]:
        """The vision tower's parameters, {} when the converter wrote none (a text-only checkpoint)."""
        if VISION_ITEM not in self.manifest["items"]:
            return {}
        # Item keys are strings: the block index in ("blocks", "3", ...) turns back into the list index.
        return {tuple(int(p) if p.isdigit() else p for p in path): a for path, a in self.restore(VISION_ITEM).items()}

    def check_unused(self) -> None:
        """Nothing to check: the converter wrote exactly the parameters (the manifest lists them)."""

    def restore(self, name: str, shardings: dict | None = None) -> dict[tuple, jax.Array]:
        """The arrays of item `name`, each restored into its sharding from `shardings` when given."""
        entries = self.manifest["items"].get(name)
        if entries is None:
            raise CheckpointError(f"{self.directory}: manifest has no item {name!r}")
        shardings = shardings or {}
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


def writer() -> ocp.AsyncCheckpointer:
    """The converter's checkpointer. Uncompressed: MXFP4 codes and random-looking bf16 weights gain
    little from zstd, which cost a third of the conversion time and slowed every restore. Host arrays
    are written without Orbax's defensive copy: the converter never modifies an array it saves."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.ArrayHandler()))
    return ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=registry))


def save_item(directory: str, name: str, arrays: dict[tuple, np.ndarray], checkpointer: ocp.AsyncCheckpointer) -> None:
    """Starts writing one item; the caller waits with `checkpointer.wait_until_finished()`."""
    tree = {key(p): a for p, a in arrays.items()}
    checkpointer.save(os.path.join(directory, PARAMS_DIR, name), args=ocp.args.PyTreeSave(tree))
