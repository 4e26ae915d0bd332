"""The checkpoint layout of the vision tower and projector.

Names as published by K2.5 and K3 (`vision_tower.*`, `mm_projector.*`), with `convert.layout.Rule`
transforms ("transpose": [out, in] -> [in, out], the tower's kernels; "vector" as stored) plus "patch": the patch
convolution [D, 3, p, p] as the linear kernel [3*p*p, D] over a patch flattened (channel, y, x).
The synthetic checkpoint writer and the loader (`k3jax.vision.weights`) both read this table.
"""

from __future__ import annotations

import numpy as np

from convert.layout import BF16, Rule
from convert.reader import CheckpointError
from k3jax.vision.config import LAYERNORM, PATCHMERGER_V2, VisionConfig

PREFIXES = ("vision_tower.", "mm_projector.")


def vision_rules(cfg: VisionConfig) -> list[Rule]:
    d, p = cfg.hidden_size, cfg.patch_size
    t = "vision_tower."
    rules = [Rule(t + "patch_embed.proj.weight", (d, 3, p, p), BF16, ("patch_embed", "kernel"), "patch"),
             Rule(t + "patch_embed.pos_emb.weight", (cfg.pos_emb_height, cfg.pos_emb_width, d), BF16,
                  ("pos_emb",), "vector")]
    if cfg.patch_embed_bias:
        rules.append(_vector(t + "patch_embed.proj.bias", d, ("patch_embed", "bias")))
    for i in range(cfg.num_layers):
        b = f"{t}encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            rules += _norm(b + norm, d, cfg.norm_type, ("blocks", i, norm))
        rules += _linear(b + "wqkv", 3 * cfg.qkv_size, d, cfg.attn_bias, ("blocks", i, "wqkv"))
        rules += _linear(b + "wo", d, cfg.qkv_size, cfg.attn_bias, ("blocks", i, "wo"))
        rules += _linear(b + "mlp.fc0", cfg.intermediate_size, d, cfg.linear_bias, ("blocks", i, "fc0"))
        rules += _linear(b + "mlp.fc1", d, cfg.intermediate_size, cfg.linear_bias, ("blocks", i, "fc1"))
    rules += _norm(t + "encoder.final_layernorm", d, cfg.norm_type, ("final_norm",))
    m, out = cfg.merged_size, cfg.text_hidden_size
    v2 = cfg.projector_type == PATCHMERGER_V2
    if not v2:
        rules += _norm("mm_projector.pre_norm", d, LAYERNORM, ("projector", "pre_norm"))
    rules += _linear("mm_projector.proj.0", m, m, not v2, ("projector", "linear_1"))
    rules += _linear("mm_projector.proj.2", out, m, not v2, ("projector", "linear_2"))
    if v2:
        rules.append(_vector("mm_projector.post_norm.weight", out, ("projector", "post_norm", "weight")))
    return rules


def vision_arrays(cfg: VisionConfig, stored: set[str], read) -> dict[tuple, np.ndarray]:
    """The tower's parameters by path (in the tower module) from checkpoint tensors: `stored` names
    every vision tensor the checkpoint has, `read(rule)` returns one as stored. A missing, unknown or
    misshapen tensor is a CheckpointError naming it."""
    rules = vision_rules(cfg)
    unknown = sorted(stored - {r.name for r in rules})
    if unknown:
        raise CheckpointError(f"{len(unknown)} vision tensors match no parameter of the vision config, "
                              f"e.g. {unknown[:5]}")
    missing = sorted(r.name for r in rules if r.name not in stored)
    if missing:
        raise CheckpointError(f"the checkpoint lacks vision tensors {missing[:5]}")
    out = {}
    for rule in rules:
        array = read(rule)
        if tuple(array.shape) != rule.shape:
            raise CheckpointError(f"{rule.name} has shape {tuple(array.shape)}, expected {rule.shape}")
        if rule.transform == "transpose":  # [out, in] -> [in, out]
            array = array.T
        elif rule.transform == "patch":  # [D, 3, p, p] -> [3*p*p, D]
            array = array.reshape(array.shape[0], -1).T
        out[rule.path] = np.ascontiguousarray(array)
    return out


def _vector(name: str, size: int, path: tuple) -> Rule:
    return Rule(name, (size,), BF16, path, "vector")


def _norm(name: str, size: int, kind: str, path: tuple) -> list[Rule]:
    rules = [_vector(name + ".weight", size, (*path, "weight"))]
    if kind == LAYERNORM:
        rules.append(_vector(name + ".bias", size, (*path, "bias")))
    return rules


def _linear(name: str, out_features: int, in_features: int, bias: bool, path: tuple) -> list[Rule]:
    rules = [Rule(name + ".weight", (out_features, in_features), BF16, (*path, "kernel"), "transpose")]
    if bias:
        rules.append(_vector(name + ".bias", out_features, (*path, "bias")))
    return rules
