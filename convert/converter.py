"""Streaming conversion of a Hugging Face checkpoint to the Orbax layout of `convert.orbax_params`.

One decoder layer (or model-level tensor) at a time is read, transformed into the parameter layout,
cast, written and checksummed while it is written, so peak host memory is about one layer. The output is written under a temporary name next
to the destination and renamed when complete: an interrupted run never leaves a directory that
looks converted.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import time

import numpy as np

from convert import layout
from convert.hf_params import HfParams
from convert.orbax_params import (FORMAT, MANIFEST, VISION_ITEM, OrbaxParams, key, layer_item, model_item, save_item,
                                  writer)
from convert.reader import CheckpointError
from k3jax.config import K3Config

# Small files that travel with the weights (tokenizer, generation defaults, remote code).
_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
               "special_tokens_map.json", "tiktoken.model", "chat_template.jinja",
               "preprocessor_config.json")


def checksum(array) -> str:
    """sha256 of the array's bytes in C order (hashed in place when the array is already contiguous)."""
    return hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).hexdigest()


def convert_checkpoint(src, dst, *, dtype: str = "bfloat16", overwrite: bool = False, verify: bool = False,
                       out=None) -> dict:
    """Converts `src` (HF safetensors directory) into `dst`; returns the manifest. Progress goes to
    `out` (default: standard error)."""
    out = out or sys.stderr
    src, dst = os.fspath(src), os.path.abspath(os.fspath(dst))
    cfg = K3Config.from_pretrained(src)
    if os.path.exists(dst) and os.listdir(dst) and not overwrite:
        raise FileExistsError(f"destination {dst} is not empty; pass --overwrite to replace it")
    source = HfParams(src, cfg, dtype=dtype)
    partial = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        manifest = _write(source, cfg, partial, dtype, out)
        for name in _SIDE_FILES:
            if os.path.exists(os.path.join(src, name)):
                shutil.copy2(os.path.join(src, name), os.path.join(partial, name))
        with open(os.path.join(partial, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        if verify:
            verify_checkpoint(partial, cfg)
        _replace(partial, dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _write(source: HfParams, cfg: K3Config, directory: str, dtype: str, out) -> dict:
    progress = _Progress(layout.checkpoint_bytes(cfg), out)
    checkpointer = writer()
    items = {}
    groups = itertools.chain(((model_item(p), lambda p=p, a=a: {p: a}) for p, a in source.model_arrays()),
                             ((layer_item(i), lambda i=i: source.layer(i)) for i in range(cfg.num_hidden_layers)),
                             [(VISION_ITEM, source.vision)])
    for name, read in groups:
        arrays = read()
        if not arrays:  # a text-only checkpoint has no vision item
            continue
        save_item(directory, name, arrays, checkpointer)
        # Hashing releases the GIL: it runs while Orbax writes the same (never modified) arrays.
        items[name] = {key(p): {"shape": list(a.shape), "dtype": str(a.dtype), "sha256": checksum(a)}
                       for p, a in arrays.items()}
        checkpointer.wait_until_finished()  # bounds host memory to the item being written
        del arrays
        progress.advance(source.bytes_read)
    source.check_unused()
    progress.done()
    return {"format": FORMAT, "dtype": dtype, "model_type": cfg.model_type,
            "source_tensors": sorted(source.used), "items": items}


def verify_checkpoint(directory, cfg: K3Config | None = None) -> None:
    """Re-reads every converted array and compares it with the manifest's checksum."""
    cfg = cfg or K3Config.from_pretrained(directory)
    params = OrbaxParams(directory, cfg)
    for name, entries in params.manifest["items"].items():
        for path, array in params.restore(name).items():
            if checksum(array) != entries[key(path)]["sha256"]:
                raise CheckpointError(f"{directory}: {name}/{key(path)} does not match its manifest checksum")


def _replace(partial: str, dst: str) -> None:
    if os.path.exists(dst):
        old = dst + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
        os.rename(partial, dst)
        shutil.rmtree(old)
    else:
        os.rename(partial, dst)


class _Progress:
    def __init__(self, total: int, out):
        self.total, self.out, self.start = max(total, 1), out, time.perf_counter()

    def advance(self, done: int) -> None:
        elapsed = time.perf_counter() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        print(f"\rconverting {done / 1e6:10.1f} / {self.total / 1e6:.1f} MB  {rate / 1e6:7.1f} MB/s  "
              f"ETA {eta:6.0f} s", end="", file=self.out, flush=True)

    def done(self) -> None:
        print(f"\nconverted in {time.perf_counter() - self.start:.1f} s", file=self.out, flush=True)
