"""Synthetic checkpoints in the exact published layout (names, dtypes, shapes, MXFP4 packing,
quantization_config), with random weights at scales that keep activations O(1).

    python -m convert.synth --preset k3-tiny --out DIR [--seed 0] [--shard-bytes N]
"""

from __future__ import annotations

import argparse
import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from convert import layout
from k3jax.config import K3Config

_NUMPY_DTYPES = {layout.BF16: ml_dtypes.bfloat16, layout.F32: np.float32, layout.U8: np.uint8}
_E2M1_RMS = 2.93  # RMS of E2M1 values over uniformly random codes
MAX_SYNTHETIC_BYTES = 8 * 10**9


def synthetic_tensor(name: str, rule: layout.Rule, rng: np.random.Generator) -> np.ndarray:
    shape, kind = rule.shape, rule.transform
    if rule.dtype == layout.U8:  # MXFP4: random codes, one power-of-two scale per 32 inputs
        if name.endswith("weight_packed"):
            return rng.integers(0, 256, size=shape, dtype=np.uint8)
        fan_in = shape[-1] * 32
        exponent = 127 + int(round(np.log2(fan_in ** -0.5 / _E2M1_RMS)))
        return np.full(shape, exponent, np.uint8)
    if name.endswith("A_log"):
        value = np.log(rng.uniform(1.0, 16.0, size=shape))
    elif name.endswith("dt_bias"):
        value = rng.uniform(-1.0, 1.0, size=shape)
    elif name.endswith("e_score_correction_bias"):
        value = 0.05 * rng.standard_normal(shape)
    elif kind == "conv":
        value = 0.5 * rng.standard_normal(shape)
    elif kind == "squeeze":  # AttnRes pseudo-query: logits of order one after the score norm
        value = shape[-1] ** -0.5 * rng.standard_normal(shape)
    elif kind == "vector" and len(shape) == 1:  # norm weights
        value = 1.0 + 0.1 * rng.standard_normal(shape)
    elif "embed_tokens" in name:
        value = rng.standard_normal(shape)
    else:  # linear [out, in] or stacked expert weights: fan-in scaled
        value = shape[-1] ** -0.5 * rng.standard_normal(shape)
    return value.astype(_NUMPY_DTYPES[rule.dtype])


def write_checkpoint(out_dir: str | os.PathLike, hf_config: dict, *, seed: int = 0,
                     shard_bytes: int | None = None) -> K3Config:
    """Writes config.json and safetensors (sharded with an index when shard_bytes is given)."""
    cfg = K3Config.from_hf_dict(hf_config)
    tensors = layout.all_tensors(cfg)
    total = sum(int(np.prod(r.shape)) * np.dtype(_NUMPY_DTYPES[r.dtype]).itemsize for r in tensors.values())
    if total > MAX_SYNTHETIC_BYTES:
        raise ValueError(f"a synthetic checkpoint of {total / 1e9:.1f} GB is too large; the limit is "
                         f"{MAX_SYNTHETIC_BYTES / 1e9:.0f} GB")
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, rule in tensors.items():
        tensor = synthetic_tensor(name, rule, rng)
        if shard_bytes and size + tensor.nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, file), metadata=metadata)
            weight_map.update({name: file for name in shard})
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    return cfg


def main(argv=None) -> None:
    from k3jax.presets import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="k3-tiny", choices=sorted(PRESETS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-bytes", type=int, default=None)
    args = parser.parse_args(argv)
    write_checkpoint(args.out, PRESETS[args.preset], seed=args.seed, shard_bytes=args.shard_bytes)
    print(f"wrote a synthetic {args.preset} checkpoint to {args.out}")


if __name__ == "__main__":
    main()
