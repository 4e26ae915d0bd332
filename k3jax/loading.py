"""`from_pretrained`: a Hugging Face checkpoint directory (K3 or Kimi Linear) -> K3Model.

The model is built abstractly (no weights allocated), then every parameter is read from the
checkpoint through the layout table in `convert.layout`, transformed, cast and placed. Stacked
layer parameters are assembled layer by layer; MXFP4 experts stay packed.
"""

from __future__ import annotations

import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert import layout
from convert.reader import CheckpointError, SafetensorsReader
from k3jax.config import K3Config
from k3jax.decoder import K3Transformer, plan_segments
from k3jax.model import K3Model, resolve_dtype

_SKIPPED = re.compile(r"(^vision_tower\.|^mm_projector\.|rotary_emb\.)")


def from_pretrained(path: str | os.PathLike, *, dtype="bfloat16", mesh=None) -> K3Model:
    """Loads a K3 or Kimi Linear checkpoint directory (config.json + safetensors, sharded or not).

    `dtype` is the activation and weight dtype ("bfloat16" or "float32"); the gate parameters, conv
    weights and router bias stay float32 and MXFP4 experts stay packed. `mesh` must be None or "1x1"
    until sharded loading lands (the [sharding] and [convert] issues).
    """
    if mesh not in (None, "1x1"):
        raise ValueError(f"mesh={mesh!r}: sharded loading is not available yet; pass mesh=None")
    cfg = K3Config.from_pretrained(path)
    reader = SafetensorsReader(path)
    abstract = nnx.eval_shape(lambda: K3Transformer(cfg, dtype=resolve_dtype(dtype)))
    graphdef, state = nnx.split(abstract)
    sources = _parameter_sources(cfg)
    used: set[str] = set()
    filled = {}
    for param_path, variable in nnx.to_flat_state(state):
        if param_path not in sources:
            raise CheckpointError(f"no checkpoint rule fills parameter {'.'.join(map(str, param_path))}")
        target = variable.get_value()
        value = _assemble(reader, param_path, sources[param_path], target.shape, used)
        filled[param_path] = variable.replace(jnp.asarray(value, target.dtype))
    _check_unused(reader, cfg, used)
    params = nnx.from_flat_state(list(filled.items()))
    return K3Model(cfg, graphdef, params)


def _parameter_sources(cfg: K3Config) -> dict[tuple, tuple[layout.Rule, list[str]]]:
    """Parameter path -> (rule, full checkpoint names); layer parameters list one name per stacked repeat."""
    decoder, _ = layout.prefixes(cfg)
    sources = {r.path: (r, [decoder + r.name]) for r in layout.model_rules(cfg)}
    head = layout.lm_head_rule(cfg)
    if head:
        sources[head.path] = (head, [head.name])
    for s, seg in enumerate(plan_segments(cfg)):
        for j, (attn, mlp) in enumerate(seg.kinds):
            for r in layout.layer_rules(cfg, attn, mlp):
                names = [f"{decoder}layers.{seg.layer_index(j, k)}.{r.name}" for k in range(seg.repeats)]
                sources[("segments", s, "layers", j, *r.path)] = (r, names)
    return sources


def _assemble(reader: SafetensorsReader, param_path, source, target_shape, used: set[str]) -> np.ndarray:
    rule, names = source
    per_layer_shape = tuple(target_shape[1:]) if param_path[0] == "segments" else tuple(target_shape)
    parts = [_read(reader, rule, name, per_layer_shape, used) for name in names]
    value = np.stack(parts) if param_path[0] == "segments" else parts[0]
    if value.shape != tuple(target_shape):
        raise CheckpointError(f"{names[0]}: after '{rule.transform}' it has shape {value.shape[1:]}, the model "
                              f"needs {per_layer_shape}")
    return value


def _read(reader: SafetensorsReader, rule: layout.Rule, name: str, target_shape, used: set[str]) -> np.ndarray:
    if rule.transform == "experts":
        num_experts = target_shape[0]
        return np.stack([_checked(reader, name.format(e=e), rule.shape, used) for e in range(num_experts)])
    array = _checked(reader, _present(reader, name, rule), None, used)
    if rule.transform == "linear":
        _expect(name, array, rule.shape)
        return array.T
    if rule.transform == "vector":
        _expect(name, array, rule.shape)
        return array
    if rule.transform == "squeeze":
        _expect(name, array, rule.shape)
        return array.reshape(-1)
    if rule.transform == "conv":  # [P, 1, W] or [P, W] -> [W, P]
        p, _, w = rule.shape
        if array.shape not in ((p, 1, w), (p, w)):
            raise CheckpointError(f"{name} has shape {array.shape}, expected {(p, 1, w)} or {(p, w)}")
        return array.reshape(p, w).T
    if rule.transform == "a_log":  # only the first `heads` entries are used (vLLM and SGLang slice too)
        heads = target_shape[0]
        if array.size < heads:
            raise CheckpointError(f"{name} has {array.size} entries, fewer than the {heads} KDA heads")
        return array.reshape(-1)[:heads]
    raise AssertionError(f"unknown transform {rule.transform}")


def _present(reader: SafetensorsReader, name: str, rule: layout.Rule) -> str:
    """`name`, or the alias under which this checkpoint stores the tensor."""
    if name in reader:
        return name
    for alias in rule.aliases:
        candidate = name.removesuffix(rule.name) + alias
        if candidate in reader:
            return candidate
    return name  # reading it raises the error that names the tensor


def _checked(reader, name, shape, used) -> np.ndarray:
    array = reader.read(name)
    if shape is not None:
        _expect(name, array, shape)
    used.add(name)
    return array


def _expect(name: str, array: np.ndarray, shape) -> None:
    if array.shape != tuple(shape):
        raise CheckpointError(f"{name} has shape {array.shape}, expected {tuple(shape)}")


def _check_unused(reader: SafetensorsReader, cfg: K3Config, used: set[str]) -> None:
    decoder, _ = layout.prefixes(cfg)
    mtp = re.compile(re.escape(decoder) + r"layers\.(\d+)\.")
    unused = []
    for name in reader.names():
        if name in used or _SKIPPED.search(name):
            continue
        m = mtp.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:  # MTP layers stored after the decoder
            continue
        unused.append(name)
    if unused:
        raise CheckpointError(f"{len(unused)} checkpoint tensors match no parameter of this config, e.g. "
                              f"{sorted(unused)[:5]}")

