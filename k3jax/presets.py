"""Named configs, written as the Hugging Face config.json dicts they stand for (parsed by K3Config)."""

from __future__ import annotations

_MXFP4_QUANT = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                        "symmetric": True, "scale_dtype": "torch.uint8"},
        }
    },
}


def _k3_layer_lists(num_layers: int, every: int) -> dict:
    """K3's schedule: MLA on every `every`-th layer and on the last one (1-indexed lists)."""
    full = sorted({i for i in range(every, num_layers + 1, every)} | {num_layers})
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    return {"kda_layers": kda, "full_attn_layers": full}


# K3's tower at CPU-test widths (the K3 variant: RMSNorm, no biases, qkv wider than the hidden
# size, bilinear position table, patchmergerv2); 2 heads of 24, whose quarters RoPE rotates on x and y.
K3_TINY_VISION = {
    "vt_hidden_size": 32,
    "qkv_hidden_size": 48,
    "vt_num_attention_heads": 2,
    "vt_intermediate_size": 128,
    "vt_num_hidden_layers": 2,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
}


def _k3(text: dict, media_placeholder_token_id: int, vision: dict = K3_TINY_VISION) -> dict:
    """K3's wrapper config; `vision` defaults to the tiny tower, which synthetic checkpoints of
    test-width configs can afford."""
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(vision),
        "media_placeholder_token_id": media_placeholder_token_id,
        "tie_word_embeddings": False,
    }


KIMI_K3_TEXT = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 33792,
    "num_hidden_layers": 93,
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    "rms_norm_eps": 1e-5,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "moe_intermediate_size": 3072,
    "num_shared_experts": 2,
    "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "attn_res_block_size": 12,
    "linear_attn_config": {
        **_k3_layer_lists(93, 4),
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1048576,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "quantization_config": _MXFP4_QUANT,
}

# Every K3 feature at CPU-test widths: KDA and MLA in the K3 pattern (MLA every 4th layer and the
# last), dense layer 0, LatentMoE with shared experts and MXFP4 experts, AttnRes over 3 blocks.
# Token ids mirror K3's layout above a byte vocabulary: 256 bytes, then K3's specials from 256
# (bos 256, eos 258, media placeholder 277 like K3's 163584 / 163586 / 163605), pad last.
K3_TINY_TEXT = {
    **KIMI_K3_TEXT,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 10,
    "num_attention_heads": 8,  # 8 heads and 16 experts: whole heads and experts per device on 8x2
    "num_key_value_heads": 8,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_experts": 16,
    "num_experts_per_token": 4,
    "moe_intermediate_size": 32,
    "num_shared_experts": 2,
    "routed_expert_hidden_size": 32,
    "attn_res_block_size": 4,
    "linear_attn_config": {
        **_k3_layer_lists(10, 4),
        "num_heads": 8,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
    "max_position_embeddings": 4096,
    "bos_token_id": 256,
    "eos_token_id": 258,
    "pad_token_id": 511,
}

# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (the published, 1-indexed form).
KIMI_LINEAR_48B = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 72,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "moe_intermediate_size": 1024,
    "num_shared_experts": 1,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "linear_attn_config": {
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "model_max_length": 1048576,
    "rope_theta": 10000.0,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
}

PRESETS = {
    "kimi-k3": _k3(KIMI_K3_TEXT, 163605, {}),  # {}: every vision key takes K3's default
    "kimi-linear-48b-a3b": KIMI_LINEAR_48B,
    "k3-tiny": _k3(K3_TINY_TEXT, 277),
}

# DSpark draft checkpoints (config.json of the draft; ARCHITECTURE.md, "DSpark draft"),
# each for the target preset named in DRAFT_TARGETS. k3-tiny-dspark: 2 dense MLA layers reading the
# residual stream after target layers 1, 4 and 8 of k3-tiny; the mask is a reserved special id of the
# synthetic byte-level tokenizer (not BOS 256, EOS 258 or pad 511).
K3_TINY_DSPARK = {
    "model_type": "k3_dspark",
    "architectures": ["K3DSparkModel"],
    "vocab_size": 512,
    "draft_vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "target_layer_ids": [1, 4, 8],
    "num_target_layers": 3,
    "target_hidden_size": 64,
    "markov_rank": 8,
    "block_size": 7,
    "dflash_config": {"mask_token_id": 300},
    "sample_from_anchor": True,
    "enable_confidence_head": False,
    "confidence_head_with_markov": False,
    "logit_scale": 1.0,
    "target_hidden_tap": "residual_sum",
    "tie_word_embeddings": False,
}

DRAFT_PRESETS = {"k3-tiny-dspark": K3_TINY_DSPARK}
DRAFT_TARGETS = {"k3-tiny-dspark": "k3-tiny"}
