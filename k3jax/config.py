"""K3Config: the text-decoder configuration of Kimi K3 and Kimi Linear, read from a Hugging Face config.

This module is a leaf (no model code), so `convert` can use it without importing the model.

Accepted inputs:
- K3's multimodal wrapper (`model_type "kimi_k3"`, with `text_config` and `vision_config`);
- Kimi Linear as published (`model_type "kimi_linear"`, 1-indexed `linear_attn_config.kda_layers` /
  `full_attn_layers`);
- Kimi Linear as saved by transformers (0-indexed `layer_types` / `mlp_layer_types`, `linear_head_dim`,
  and the alias names `num_local_experts`, `num_experts_per_tok`, `n_shared_experts`, `n_group`,
  `norm_topk_prob`).
Feature switches come from keys, never from the model name (ARCHITECTURE.md, "Model facts the code relies on").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from pallas_kernels.mxfp4_format import GROUP

KDA = "kda"
MLA = "mla"
DENSE = "dense"
MOE = "moe"

# vLLM and SGLang hard-code the K3 KDA output-norm eps (not read from the config); Kimi Linear's
# reference implementations (transformers, the released modeling code) use rms_norm_eps there.
K3_KDA_OUTPUT_NORM_EPS = 1e-5

# Alias -> canonical key, as transformers' KimiLinearConfig.attribute_map writes them.
_ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
    "model_max_length": "max_position_embeddings",
}


class ConfigError(ValueError):
    """A config value is missing or inconsistent; the message names the key."""


class MLASizes:
    """The sizes k3jax.layers.mla derives from a config's MLA fields (kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim): the target's K3Config and the DSpark draft's DSparkConfig both have them."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token per MLA layer: the normalised latent plus the shared key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class K3Config(MLASizes):
    """Every key the text model reads, with the vLLM/SGLang `KimiLinearConfig` defaults."""

    model_type: str = "kimi_linear"  # of the outer config: "kimi_k3" or "kimi_linear"
    vocab_size: int = 163840
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32  # unused by MLA math
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # vLLM's default is False, but every released Kimi model is NoPE and transformers' Kimi Linear
    # never rotates (its saved configs carry no such key): RoPE only when a config asks for it.
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # MoE
    num_experts: int | None = None
    num_experts_per_token: int | None = None
    moe_intermediate_size: int | None = None
    num_shared_experts: int = 0
    routed_expert_hidden_size: int | None = None  # LatentMoE width; None: no LatentMoE
    latent_moe_use_norm: bool = False
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    experts_mxfp4: bool = False  # routed experts stored as MXFP4 (from quantization_config)
    # AttnRes
    attn_res_block_size: int | None = None
    # KDA (linear_attn_config)
    kda_num_heads: int = 32
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_gate_lower_bound: float | None = None  # None: the unbounded softplus gate (Kimi Linear)
    kda_full_rank_gate: bool = False  # output gate g_proj (K3) instead of g_a/g_b (Kimi Linear)
    kda_output_norm_eps: float = 1e-6
    # Layer schedule, 0-indexed: "kda"/"mla" and "dense"/"moe" per layer.
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    # Other
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    logit_scale: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    media_placeholder_token_id: int | None = None
    vision_config: dict | None = dataclasses.field(default=None, compare=False, hash=False)

    def __post_init__(self):
        _validate(self)

    # ---- derived properties -------------------------------------------------------------------
    @property
    def attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def kda_projection_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def moe_input_size(self) -> int:
        """Width the routed experts read: the latent when LatentMoE is on, else the hidden size."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def num_attn_res_blocks(self) -> int:
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size) if self.attn_res else 0

    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        """(attention kind, mlp kind) of every layer."""
        return tuple(zip(self.layer_types, self.mlp_layer_types))

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "K3Config":
        return _from_hf_dict(d)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "K3Config":
        with open(path) as f:
            return _from_hf_dict(json.load(f))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "K3Config":
        """Reads `config.json` from a checkpoint directory (or the file itself)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_json_file(path)

    @classmethod
    def from_preset(cls, name: str) -> "K3Config":
        from k3jax.presets import PRESETS

        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return _from_hf_dict(PRESETS[name])

    def replace(self, **changes) -> "K3Config":
        return dataclasses.replace(self, **changes)


def fixed_router_bias(num_experts: int) -> list[float]:
    """Router correction biases E, E - 1, ..., 1: every token takes experts 0..k-1 by margins of 1,
    wider than any difference of sigmoid scores, so two numeric paths never route apart (a synthetic
    checkpoint's `fixed_routing`, `K3Model.with_fixed_routing`; random routers have near-ties that
    rounding flips)."""
    return [float(e) for e in range(num_experts, 0, -1)]


def _from_hf_dict(raw: dict[str, Any]) -> K3Config:
    outer_type = raw.get("model_type", "kimi_linear")
    if outer_type == "kimi_k3":
        if "text_config" not in raw:
            raise ConfigError("kimi_k3 config has no 'text_config'")
        text = dict(raw["text_config"])
        # The wrapper carries the token ids and (sometimes) the quantization config.
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config",
                    "media_placeholder_token_id", "tie_word_embeddings"):
            if key in raw and key not in text:
                text[key] = raw[key]
        vision = raw.get("vision_config")
    elif outer_type == "kimi_linear":
        text, vision = dict(raw), None
    else:
        raise ConfigError(f"model_type {outer_type!r} is not supported (expected 'kimi_k3' or 'kimi_linear')")

    for alias, canonical in _ALIASES.items():
        if alias in text and text[alias] is not None:
            if canonical in text and text[canonical] is not None and text[canonical] != text[alias]:
                raise ConfigError(f"'{alias}' ({text[alias]}) disagrees with '{canonical}' ({text[canonical]})")
            text[canonical] = text.pop(alias)
        else:
            text.pop(alias, None)

    fields = {f.name for f in dataclasses.fields(K3Config)}
    kw = {k: v for k, v in text.items() if k in fields and v is not None}
    kw.pop("layer_types", None)
    kw.pop("mlp_layer_types", None)
    kw["model_type"] = outer_type
    if "rope_parameters" in text and isinstance(text["rope_parameters"], dict):
        kw.setdefault("rope_theta", text["rope_parameters"].get("rope_theta", 10000.0))

    num_layers = int(text.get("num_hidden_layers", K3Config.num_hidden_layers))
    lac = text.get("linear_attn_config") or {}
    kw["kda_num_heads"] = lac.get("num_heads", text.get("linear_num_heads", K3Config.kda_num_heads))
    kw["kda_head_dim"] = lac.get("head_dim", text.get("linear_head_dim", K3Config.kda_head_dim))
    kw["kda_conv_size"] = lac.get("short_conv_kernel_size",
                                  text.get("linear_conv_kernel_dim", K3Config.kda_conv_size))
    kw["kda_gate_lower_bound"] = lac.get("gate_lower_bound")
    kw["kda_full_rank_gate"] = bool(lac.get("use_full_rank_gate", False))
    kw["kda_output_norm_eps"] = (K3_KDA_OUTPUT_NORM_EPS if outer_type == "kimi_k3"
                                 else float(text.get("rms_norm_eps", K3Config.rms_norm_eps)))
    kw["layer_types"] = _attention_layer_types(text, lac, num_layers)
    kw["mlp_layer_types"] = _mlp_layer_types(text, num_layers)
    kw["experts_mxfp4"] = _experts_are_mxfp4(text.get("quantization_config"))
    kw["vision_config"] = vision
    return K3Config(**kw)


def _attention_layer_types(text: dict, lac: dict, num_layers: int) -> tuple[str, ...]:
    from_list = None
    if lac.get("kda_layers") is not None or lac.get("full_attn_layers") is not None:
        kda = list(lac.get("kda_layers") or [])
        full = list(lac.get("full_attn_layers") or [])
        for name, ids in (("kda_layers", kda), ("full_attn_layers", full)):
            bad = [i for i in ids if not (isinstance(i, int) and 1 <= i <= num_layers)]
            if bad:
                raise ConfigError(f"linear_attn_config.{name} holds {bad}: entries are 1-indexed layer "
                                  f"numbers in 1..num_hidden_layers={num_layers}")
        if set(kda) & set(full):
            raise ConfigError(f"layers {sorted(set(kda) & set(full))} are in both linear_attn_config."
                              "kda_layers and full_attn_layers")
        missing = sorted(set(range(1, num_layers + 1)) - set(kda) - set(full))
        if missing:
            raise ConfigError(f"linear_attn_config.kda_layers and full_attn_layers do not cover layers "
                              f"{missing} (1-indexed) of num_hidden_layers={num_layers}")
        from_list = tuple(KDA if i + 1 in kda else MLA for i in range(num_layers))
    from_types = _named_list(text, "layer_types", {"linear_attention": KDA, "full_attention": MLA}, num_layers)
    if from_list and from_types and from_list != from_types:
        raise ConfigError("layer_types (0-indexed) and linear_attn_config.kda_layers (1-indexed) disagree")
    result = from_types or from_list
    if result is None:
        raise ConfigError("the config names no layer schedule: give linear_attn_config.kda_layers / "
                          "full_attn_layers or layer_types")
    return result


def _named_list(text: dict, key: str, names: dict[str, str], num_layers: int) -> tuple[str, ...] | None:
    """A 0-indexed per-layer list of names as transformers writes it (`layer_types`, `mlp_layer_types`)."""
    if text.get(key) is None:
        return None
    types = list(text[key])
    if len(types) != num_layers:
        raise ConfigError(f"{key} has {len(types)} entries for num_hidden_layers={num_layers}")
    bad = sorted({t for t in types if t not in names})
    if bad:
        raise ConfigError(f"{key} holds {bad}; expected one of {sorted(names)}")
    return tuple(names[t] for t in types)


def _mlp_layer_types(text: dict, num_layers: int) -> tuple[str, ...]:
    listed = _named_list(text, "mlp_layer_types", {"dense": DENSE, "sparse": MOE}, num_layers)
    if listed is not None:
        return listed
    has_experts = text.get("num_experts") is not None
    first_dense = int(text.get("first_k_dense_replace", K3Config.first_k_dense_replace))
    freq = int(text.get("moe_layer_freq", K3Config.moe_layer_freq))
    if freq < 1:
        raise ConfigError(f"moe_layer_freq must be >= 1, got {freq}")
    return tuple(MOE if has_experts and i >= first_dense and i % freq == 0 else DENSE
                 for i in range(num_layers))


def _experts_are_mxfp4(qc: dict | None) -> bool:
    if not qc:
        return False
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    formats = {fmt} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    if "mxfp4-pack-quantized" in formats or qc.get("quant_method") == "mxfp4":
        for g in groups.values():
            w = (g or {}).get("weights") or {}
            if w.get("group_size", GROUP) != GROUP or w.get("num_bits", 4) != 4:
                raise ConfigError(f"quantization_config group has weights {w}; MXFP4 needs num_bits 4, "
                                  f"group_size {GROUP}")
        return True
    raise ConfigError(f"quantization_config {qc.get('quant_method')!r}/{fmt!r} is not supported "
                      "(only compressed-tensors mxfp4-pack-quantized routed experts)")


def _validate(c: K3Config) -> None:
    def positive(name):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim",
                 "kda_conv_size"):
        positive(name)
    if c.qk_rope_head_dim < 0:
        raise ConfigError(f"qk_rope_head_dim must be >= 0, got {c.qk_rope_head_dim}")
    if c.q_lora_rank is not None:
        positive("q_lora_rank")
    if not c.mla_use_nope and c.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={c.qk_rope_head_dim} must be even when RoPE is on "
                          "(mla_use_nope false)")
    if c.kda_conv_size < 2:
        raise ConfigError(f"linear_attn_config.short_conv_kernel_size must be >= 2, got {c.kda_conv_size}")
    if c.kda_gate_lower_bound is not None and not c.kda_gate_lower_bound < 0:
        raise ConfigError(f"linear_attn_config.gate_lower_bound must be negative, got {c.kda_gate_lower_bound}")
    if c.hidden_act not in ("silu", "situ"):
        raise ConfigError(f"hidden_act {c.hidden_act!r} is not supported (expected 'silu' or 'situ')")
    if len(c.layer_types) != c.num_hidden_layers or len(c.mlp_layer_types) != c.num_hidden_layers:
        raise ConfigError(f"the layer schedule must have num_hidden_layers={c.num_hidden_layers} entries")
    if c.attn_res_block_size is not None:
        positive("attn_res_block_size")
    if MOE in c.mlp_layer_types:
        _validate_moe(c, positive)
    if DENSE in c.mlp_layer_types:
        positive("intermediate_size")


def _validate_moe(c: K3Config, positive) -> None:
    for name in ("num_experts", "num_experts_per_token", "moe_intermediate_size", "num_expert_group",
                 "topk_group"):
        if getattr(c, name) is None:
            raise ConfigError(f"MoE layers need {name}")
        positive(name)
    if c.num_experts_per_token > c.num_experts:
        raise ConfigError(f"num_experts_per_token={c.num_experts_per_token} exceeds num_experts={c.num_experts}")
    if c.num_experts % c.num_expert_group:
        raise ConfigError(f"num_experts={c.num_experts} is not divisible by num_expert_group={c.num_expert_group}")
    if c.topk_group > c.num_expert_group:
        raise ConfigError(f"topk_group={c.topk_group} exceeds num_expert_group={c.num_expert_group}")
    if c.topk_group * (c.num_experts // c.num_expert_group) < c.num_experts_per_token:
        raise ConfigError(f"topk_group={c.topk_group} groups of {c.num_experts // c.num_expert_group} experts "
                          f"cannot supply num_experts_per_token={c.num_experts_per_token}")
    if c.moe_router_activation_func not in ("sigmoid", "softmax"):
        raise ConfigError(f"moe_router_activation_func {c.moe_router_activation_func!r} is not supported")
    if c.routed_expert_hidden_size is not None:
        positive("routed_expert_hidden_size")
    if c.hidden_act == "situ" and c.activation_situ_beta is None:
        raise ConfigError("hidden_act 'situ' needs activation_situ_beta (the routed experts require it)")
    if c.experts_mxfp4:
        for key, width in (("routed_expert_hidden_size" if c.latent_moe else "hidden_size", c.moe_input_size),
                           ("moe_intermediate_size", c.moe_intermediate_size)):
            if width % GROUP:
                raise ConfigError(f"MXFP4 group size {GROUP} does not divide {key}={width} "
                                  "(an expert input width)")
