"""Small configs shared by the model tests (HF config dicts, parsed by K3Config)."""

import copy

from k3jax.config import K3Config
from k3jax.presets import PRESETS

# Kimi Linear's features at tiny widths: plain q_proj, softplus gate, low-rank output gate, standard
# residual, bf16 (unquantized) experts with grouped top-k and routed scaling, no LatentMoE.
KIMI_LINEAR_TINY = {
    "model_type": "kimi_linear",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 32,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "moe_renormalize": True,
    "num_expert_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6], "num_heads": 2,
                           "head_dim": 16, "short_conv_kernel_size": 4},
    "tie_word_embeddings": False,
}


def k3_tiny() -> K3Config:
    return K3Config.from_preset("k3-tiny")


def kimi_linear_tiny() -> K3Config:
    return K3Config.from_hf_dict(copy.deepcopy(KIMI_LINEAR_TINY))


def k3_tiny_dict() -> dict:
    return copy.deepcopy(PRESETS["k3-tiny"])
