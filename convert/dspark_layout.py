"""The K3 DSpark draft checkpoint layout (ARCHITECTURE.md, "DSpark draft"): every
tensor name, its shape as stored ([out, in] for linears) and the draft parameter it fills.

Paths are those of k3jax.dspark.model.DSparkDraft, whose linear kernels keep the stored [out, in]
(the confidence head's kernel is kept [in, 1]). Names carry no `model.` prefix (a loader strips one).
"""

from __future__ import annotations

from typing import NamedTuple

from k3jax.dspark.config import DSparkConfig

# Tensors a draft checkpoint may carry that the draft does not use: the target's are shared.
IGNORED_PREFIXES = ("embed_tokens.", "lm_head.")
CONFIDENCE_PREFIX = "confidence_head."


class DraftTensor(NamedTuple):
    shape: tuple[int, ...]  # as stored
    path: tuple  # of the draft parameter
    transpose: bool  # stored [out, in], kept [in, out] (the confidence head's kernel only)


def draft_tensors(cfg: DSparkConfig) -> dict[str, DraftTensor]:
    h, heads, f = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size

    def linear(name, out_features, in_features, path):
        return {name: DraftTensor((out_features, in_features), path + ("kernel",), False)}

    def norm(name, size, path):
        return {name: DraftTensor((size,), path + ("weight",), False)}

    out = {**linear("context_proj.weight", h, cfg.context_width, ("context_proj",)),
           **norm("context_norm.weight", h, ("context_norm",)),
           **norm("final_norm.weight", h, ("final_norm",)),
           "markov_head.markov_w1.weight": DraftTensor((cfg.vocab_size, cfg.markov_rank), ("markov_w1",), False),
           "markov_head.markov_w2.weight": DraftTensor((cfg.vocab_size, cfg.markov_rank), ("markov_w2",), False)}
    for i in range(cfg.num_hidden_layers):
        name, path = f"layers.{i}.", ("layers", i)
        attn, attn_path = name + "self_attn.", path + ("self_attn",)
        out.update(norm(name + "input_layernorm.weight", h, path + ("input_layernorm",)))
        out.update(norm(name + "post_attention_layernorm.weight", h, path + ("post_attention_layernorm",)))
        out.update(linear(attn + "q_a_proj.weight", cfg.q_lora_rank, h, attn_path + ("q_a_proj",)))
        out.update(norm(attn + "q_a_layernorm.weight", cfg.q_lora_rank, attn_path + ("q_a_layernorm",)))
        out.update(linear(attn + "q_b_proj.weight", heads * cfg.qk_head_dim, cfg.q_lora_rank, attn_path + ("q_b_proj",)))
        out.update(linear(attn + "kv_a_proj_with_mqa.weight", cfg.mla_cache_width, h, attn_path + ("kv_a_proj_with_mqa",)))
        out.update(norm(attn + "kv_a_layernorm.weight", cfg.kv_lora_rank, attn_path + ("kv_a_layernorm",)))
        out.update(linear(attn + "kv_b_proj.weight", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                          cfg.kv_lora_rank, attn_path + ("kv_b_proj",)))
        out.update(linear(attn + "o_proj.weight", h, heads * cfg.v_head_dim, attn_path + ("o_proj",)))
        for proj, (o, i_) in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
            out.update(linear(f"{name}mlp.{proj}.weight", o, i_, path + ("mlp", proj)))
    if cfg.enable_confidence_head:  # fp32 Linear(hidden [+ markov_rank] -> 1) with bias
        out["confidence_head.proj.weight"] = DraftTensor((1, cfg.confidence_width), ("confidence_kernel",), True)
        out["confidence_head.proj.bias"] = DraftTensor((1,), ("confidence_bias",), False)
    return out
