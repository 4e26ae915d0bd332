"""The published checkpoint layout of K3 and Kimi Linear, and how each tensor maps onto the
parameter tree (ARCHITECTURE.md, "Checkpoint names").

Each `Rule` names one checkpoint tensor (relative to its layer, or to the model), the shape and dtype
it is stored with, the parameter path it fills and the transform on the way:
- "linear": a Linear kernel, [out, in] as stored;
- "vector": as stored;
- "squeeze": the AttnRes pseudo-query [1, H] -> [H];
- "conv": depthwise conv [P, 1, W] (or [P, W]) -> [W, P];
- "a_log": A_log stored [128] (K3) or [1, 1, heads, 1] (Kimi Linear) -> its first `heads` entries;
- "experts": one tensor per expert ("{e}" in the name), stacked to [E, ...] as stored (MXFP4 stays packed).
The synthetic checkpoint writer and the loader both read this table, so they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math

from k3jax.config import DENSE, KDA, K3Config
from pallas_kernels.mxfp4_format import GROUP

BF16, F32, U8 = "BF16", "F32", "U8"


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str  # checkpoint name relative to the layer ("self_attn.q_proj.weight") or the model
    shape: tuple[int, ...]  # as stored (per expert for "experts")
    dtype: str  # safetensors dtype as published
    path: tuple[str, ...]  # parameter path relative to the layer module (or the model)
    transform: str
    aliases: tuple[str, ...] = ()  # other names the same tensor is found under


def prefixes(cfg: K3Config) -> tuple[str, str]:
    """(prefix of the decoder tensors, name of the LM head) as published."""
    if cfg.model_type == "kimi_k3":
        return "language_model.model.", "language_model.lm_head.weight"
    return "model.", "lm_head.weight"


def model_rules(cfg: K3Config) -> list[Rule]:
    h, v = cfg.hidden_size, cfg.vocab_size
    rules = [Rule("embed_tokens.weight", (v, h), BF16, ("embed_tokens",), "vector"),
             Rule("norm.weight", (h,), BF16, ("norm", "weight"), "vector")]
    if cfg.attn_res:
        rules += [Rule("output_attn_res_norm.weight", (h,), BF16, ("output_attn_res", "norm"), "vector"),
                  Rule("output_attn_res_proj.weight", (1, h), BF16, ("output_attn_res", "proj"), "squeeze")]
    return rules


def lm_head_rule(cfg: K3Config) -> Rule | None:
    if cfg.tie_word_embeddings:
        return None
    return Rule(prefixes(cfg)[1], (cfg.vocab_size, cfg.hidden_size), BF16, ("lm_head", "kernel"), "linear")


def layer_rules(cfg: K3Config, attn: str, mlp: str) -> list[Rule]:
    h = cfg.hidden_size
    rules = [_vector("input_layernorm.weight", h), _vector("post_attention_layernorm.weight", h)]
    if cfg.attn_res:
        for read, module in (("self_attention_res", "self_attention_res"), ("mlp_res", "mlp_res")):
            rules += [Rule(f"{read}_norm.weight", (h,), BF16, (module, "norm"), "vector"),
                      Rule(f"{read}_proj.weight", (1, h), BF16, (module, "proj"), "squeeze")]
    rules += _kda_rules(cfg) if attn == KDA else _mla_rules(cfg)
    # transformers' save_pretrained writes the dense MLP under block_sparse_moe too.
    rules += _dense_rules(cfg, "mlp", cfg.intermediate_size, "block_sparse_moe") if mlp == DENSE else _moe_rules(cfg)
    return rules


def _linear(name: str, out_features: int, in_features: int) -> Rule:
    module = name.removesuffix(".weight")
    return Rule(name, (out_features, in_features), BF16, (*module.split("."), "kernel"), "linear")


def _vector(name: str, size: int, dtype: str = BF16) -> Rule:
    return Rule(name, (size,), dtype, tuple(name.split(".")), "vector")


def _kda_rules(cfg: K3Config) -> list[Rule]:
    h, p, d, heads = cfg.hidden_size, cfg.kda_projection_size, cfg.kda_head_dim, cfg.kda_num_heads
    a = "self_attn."
    rules = [_linear(a + f"{x}_proj.weight", p, h) for x in "qkv"]
    if cfg.kda_full_rank_gate:
        rules.append(_linear(a + "g_proj.weight", p, h))
    else:
        rules += [_linear(a + "g_a_proj.weight", d, h), _linear(a + "g_b_proj.weight", p, d)]
    rules += [_linear(a + "f_a_proj.weight", d, h), _linear(a + "f_b_proj.weight", p, d),
              _linear(a + "b_proj.weight", heads, h)]
    rules += [Rule(a + f"{x}_conv1d.weight", (p, 1, cfg.kda_conv_size), F32, ("self_attn", f"{x}_conv1d"), "conv")
              for x in "qkv"]
    # K3 stores A_log with head_dim entries (only the first `heads` are read); Kimi Linear [1, 1, heads, 1].
    a_log_shape = (max(heads, d),) if cfg.model_type == "kimi_k3" else (1, 1, heads, 1)
    rules += [Rule(a + "A_log", a_log_shape, F32, ("self_attn", "A_log"), "a_log"),
              Rule(a + "dt_bias", (p,), F32, ("self_attn", "dt_bias"), "vector"),
              Rule(a + "o_norm.weight", (d,), F32, ("self_attn", "o_norm"), "vector"),
              _linear(a + "o_proj.weight", h, p)]
    return rules


def _mla_rules(cfg: K3Config) -> list[Rule]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    a = "self_attn."
    if cfg.q_lora_rank:
        rules = [_linear(a + "q_a_proj.weight", cfg.q_lora_rank, h),
                 _vector(a + "q_a_layernorm.weight", cfg.q_lora_rank),
                 _linear(a + "q_b_proj.weight", heads * cfg.qk_head_dim, cfg.q_lora_rank)]
    else:
        rules = [_linear(a + "q_proj.weight", heads * cfg.qk_head_dim, h)]
    rules += [_linear(a + "kv_a_proj_with_mqa.weight", cfg.mla_cache_width, h),
              _vector(a + "kv_a_layernorm.weight", cfg.kv_lora_rank),
              _linear(a + "kv_b_proj.weight", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)]
    if cfg.mla_use_output_gate:
        rules.append(_linear(a + "g_proj.weight", heads * cfg.v_head_dim, h))
    rules.append(_linear(a + "o_proj.weight", h, heads * cfg.v_head_dim))
    return rules


def _dense_rules(cfg: K3Config, module: str, width: int, alias: str | None = None) -> list[Rule]:
    h = cfg.hidden_size
    rules = [_linear(f"{module}.gate_proj.weight", width, h), _linear(f"{module}.up_proj.weight", width, h),
             _linear(f"{module}.down_proj.weight", h, width)]
    if alias:
        rules = [dataclasses.replace(r, aliases=(r.name.replace(module, alias, 1),)) for r in rules]
    return rules


def _moe_rules(cfg: K3Config) -> list[Rule]:
    h, e, f, d = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_input_size
    m = "block_sparse_moe."
    rules = [_linear(m + "gate.weight", e, h), _vector(m + "gate.e_score_correction_bias", e, F32)]
    if cfg.latent_moe:
        lat = cfg.routed_expert_hidden_size
        rules.append(_linear(m + "routed_expert_down_proj.weight", lat, h))
        if cfg.latent_moe_use_norm:
            rules.append(_vector(m + "routed_expert_norm.weight", lat))
        rules.append(_linear(m + "routed_expert_up_proj.weight", h, lat))
    if cfg.num_shared_experts:
        rules += _dense_rules(cfg, m + "shared_experts", cfg.num_shared_experts * f)
    for w, (out_f, in_f) in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f))):
        base = (*m.rstrip(".").split("."), "experts", w)
        if cfg.experts_mxfp4:
            rules += [Rule(m + f"experts.{{e}}.{w}.weight_packed", (out_f, in_f // 2), U8, (*base, "packed"), "experts"),
                      Rule(m + f"experts.{{e}}.{w}.weight_scale", (out_f, in_f // GROUP), U8, (*base, "scales"), "experts")]
        else:
            rules.append(Rule(m + f"experts.{{e}}.{w}.weight", (out_f, in_f), BF16, base, "experts"))
    return rules


def all_tensors(cfg: K3Config) -> dict[str, Rule]:
    """Every text tensor of a checkpoint of this config, by full name (experts expanded)."""
    decoder, _ = prefixes(cfg)
    out = {decoder + r.name: r for r in model_rules(cfg)}
    head = lm_head_rule(cfg)
    if head:
        out[head.name] = head
    for i, (attn, mlp) in enumerate(cfg.layer_kinds()):
        for r in layer_rules(cfg, attn, mlp):
            names = [r.name.format(e=e) for e in range(cfg.num_experts)] if r.transform == "experts" else [r.name]
            for n in names:
                out[f"{decoder}layers.{i}.{n}"] = r
    return out


_ITEMSIZE = {BF16: 2, F32: 4, U8: 1}


def tensor_bytes(rule: Rule) -> int:
    return math.prod(rule.shape) * _ITEMSIZE[rule.dtype]


def checkpoint_bytes(cfg: K3Config) -> int:
    """Bytes of the text tensors of a checkpoint of this config, as published."""
    return sum(tensor_bytes(r) for r in all_tensors(cfg).values())
