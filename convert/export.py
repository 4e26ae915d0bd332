"""Parameters in the model's layout -> a checkpoint in the published layout: the inverse of
`convert.hf_params`, through the same table (`convert.layout`), so writer and reader cannot drift.

Used for the embedded k3-tiny that `k3jax.train` trains: its fp32 parameters (experts as plain
arrays) become bf16 safetensors with MXFP4 experts, exactly what a published K3 checkpoint holds;
and for its DSpark draft (`write_draft`, by `convert.dspark_layout`).
"""

from __future__ import annotations

import copy
import json
import math
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from convert import layout, mxfp4
from convert.dspark_layout import CONFIDENCE_PREFIX, draft_tensors
from convert.reader import SafetensorsReader
from convert.synth import write_tokenizer
from convert.vision_layout import PREFIXES as VISION_PREFIXES
from convert.vision_layout import vision_rules
from k3jax.config import K3Config
from k3jax.dspark.config import DSparkConfig
from k3jax.vision.config import VisionConfig

_NUMPY_DTYPES = {layout.BF16: ml_dtypes.bfloat16, layout.F32: np.float32}


def stored(rule: layout.Rule, param: np.ndarray) -> np.ndarray:
    """A parameter as its checkpoint tensor stores it (the inverse of the rule's transform)."""
    param = np.asarray(param, np.float32)
    if rule.transform == "transpose":
        value = param.T
    elif rule.transform == "squeeze":
        value = param[None]
    elif rule.transform in ("conv", "patch"):  # [W, P] -> [P, 1, W] (or [P, W]); [3*p*p, D] -> [D, 3, p, p]
        value = param.T.reshape(rule.shape)
    elif rule.transform == "a_log":  # the stored entries past the model's heads are never read
        value = np.zeros(math.prod(rule.shape), np.float32)
        value[:param.size] = param.reshape(-1)
        value = value.reshape(rule.shape)
    else:
        value = param
    if value.shape != rule.shape:
        raise ValueError(f"{rule.name}: the parameter gives shape {value.shape}, the checkpoint stores {rule.shape}")
    return np.ascontiguousarray(value, _NUMPY_DTYPES[rule.dtype])  # safetensors writes the buffer as laid out


def checkpoint_tensors(cfg: K3Config, params: dict[tuple, np.ndarray]) -> dict[str, np.ndarray]:
    """Every text tensor of `cfg`'s checkpoint from `params` (parameter path -> array, as
    `nnx.to_flat_state` gives them). Expert weights are plain [E, out, in] arrays; when the config
    has MXFP4 experts they are quantized here (`convert.mxfp4.quantize`)."""
    decoder, _ = layout.prefixes(cfg)
    out = {decoder + r.name: stored(r, params[r.path]) for r in layout.model_rules(cfg)}
    head = layout.lm_head_rule(cfg)
    if head:
        out[head.name] = stored(head, params[head.path])
    for i, (attn, mlp) in enumerate(cfg.layer_kinds()):
        prefix = f"{decoder}layers.{i}."
        quantized = {}
        for rule in layout.layer_rules(cfg, attn, mlp):
            if rule.transform != "experts":
                out[prefix + rule.name] = stored(rule, params[("layers", i) + rule.path])
                continue
            if cfg.experts_mxfp4:  # the rule's path ends in "packed" or "scales" under the weight's path
                weight = ("layers", i) + rule.path[:-1]
                if weight not in quantized:
                    quantized[weight] = dict(zip(("packed", "scales"), mxfp4.quantize(params[weight]), strict=True))
                stack = quantized[weight][rule.path[-1]]
            else:
                stack = np.asarray(params[("layers", i) + rule.path], _NUMPY_DTYPES[rule.dtype])
            out.update({prefix + rule.name.format(e=e): stack[e] for e in range(cfg.num_experts)})
    return out


def write_checkpoint(out_dir: str | os.PathLike, hf_config: dict, params: dict[tuple, np.ndarray]) -> K3Config:
    """config.json, model.safetensors (text tensors only: `add_vision_tensors` adds the tower) and
    the byte-level tokenizer of `convert.synth`."""
    cfg = K3Config.from_hf_dict(copy.deepcopy(hf_config))  # it normalises the dict it reads
    os.makedirs(out_dir, exist_ok=True)
    save_file(checkpoint_tensors(cfg, params), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    write_tokenizer(out_dir, cfg)
    return cfg


def vision_checkpoint_tensors(cfg: VisionConfig, params: dict[tuple, np.ndarray]) -> dict[str, np.ndarray]:
    """The tower's and projector's tensors (`vision_tower.*`, `mm_projector.*`) from the tower
    module's parameters by path: the inverse of `convert.vision_layout.vision_arrays`."""
    return {rule.name: stored(rule, params[rule.path]) for rule in vision_rules(cfg)}


def add_vision_tensors(out_dir: str | os.PathLike, cfg: VisionConfig, params: dict[tuple, np.ndarray]) -> None:
    """Rewrites out_dir/model.safetensors with the tower's tensors beside the text tensors, which are
    copied byte for byte (the text model stays exactly as written)."""
    reader = SafetensorsReader(out_dir)
    tensors = {name: reader.read(name) for name in reader.names() if not name.startswith(VISION_PREFIXES)}
    tensors.update(vision_checkpoint_tensors(cfg, params))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def write_draft(out_dir: str | os.PathLike, draft_config: dict, params: dict[tuple, np.ndarray]) -> None:
    """A DSpark draft checkpoint from the draft module's parameters by path: config.json and bf16
    safetensors by `convert.dspark_layout`'s names (linears stored [out, in]; the confidence head,
    when enabled, fp32): the inverse of `k3jax.dspark.loading.load_draft`."""
    cfg = DSparkConfig.from_dict(draft_config)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for name, tensor in draft_tensors(cfg).items():
        value = np.asarray(params[tensor.path], np.float32)
        value = value.T if tensor.transpose else value
        dtype = np.float32 if name.startswith(CONFIDENCE_PREFIX) else ml_dtypes.bfloat16
        tensors[name] = np.ascontiguousarray(value, dtype)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(draft_config, f, indent=2)
