"""Parameter counts and cache sizes computed from a K3Config alone (no arrays are built)."""

from __future__ import annotations

from k3jax.config import DENSE, KDA, MLA, K3Config

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "float8_e4m3fn": 1}


def _kda_params(c: K3Config) -> int:
    h, p, d = c.hidden_size, c.kda_projection_size, c.kda_head_dim
    n = 3 * h * p  # q, k, v
    n += h * p if c.kda_full_rank_gate else h * d + d * p  # output gate: g_proj or g_a / g_b
    n += h * d + d * p  # forget gate f_a / f_b
    n += h * c.kda_num_heads  # b_proj
    n += 3 * p * c.kda_conv_size  # q/k/v depthwise conv
    n += c.kda_num_heads + p + d  # A_log (one per head is used), dt_bias, o_norm
    n += p * h  # o_proj
    return n


def _mla_params(c: K3Config) -> int:
    h, heads = c.hidden_size, c.num_attention_heads
    if c.q_lora_rank:
        n = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * c.qk_head_dim
    else:
        n = h * heads * c.qk_head_dim
    n += h * c.mla_cache_width + c.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
    n += c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)  # kv_b_proj
    if c.mla_use_output_gate:
        n += h * heads * c.v_head_dim
    n += heads * c.v_head_dim * h  # o_proj
    return n


def _moe_params(c: K3Config, active: bool) -> int:
    h, e = c.hidden_size, c.num_experts
    n = h * e + e  # router weight and e_score_correction_bias
    if c.latent_moe:
        n += 2 * h * c.routed_expert_hidden_size + (c.routed_expert_hidden_size if c.latent_moe_use_norm else 0)
    n += 3 * h * c.moe_intermediate_size * c.num_shared_experts
    per_expert = 3 * c.moe_input_size * c.moe_intermediate_size
    n += per_expert * (c.num_experts_per_token if active else e)
    return n


def _layer_params(c: K3Config, attn: str, mlp: str, active: bool) -> int:
    n = 2 * c.hidden_size  # input_layernorm, post_attention_layernorm
    if c.attn_res:
        n += 4 * c.hidden_size  # norm + pseudo-query for the attention and the mlp read
    n += _kda_params(c) if attn == KDA else _mla_params(c)
    n += 3 * c.hidden_size * c.intermediate_size if mlp == DENSE else _moe_params(c, active)
    return n


def param_count(cfg: K3Config) -> int:
    """All parameters of the text decoder (MXFP4 experts counted as logical weights, not bytes)."""
    return _count(cfg, active=False, with_embedding=True)


def active_param_count(cfg: K3Config) -> int:
    """Parameters touched per token (top-k routed experts only), excluding the input embedding."""
    return _count(cfg, active=True, with_embedding=False)


def _count(c: K3Config, active: bool, with_embedding: bool) -> int:
    n = sum(_layer_params(c, a, m, active) for a, m in c.layer_kinds())
    n += c.hidden_size  # final norm
    if c.attn_res:
        n += 2 * c.hidden_size  # output_attn_res norm + proj
    if with_embedding:
        n += c.vocab_size * c.hidden_size
    if not c.tie_word_embeddings or not with_embedding:
        n += c.vocab_size * c.hidden_size  # LM head
    return n


def mla_cache_bytes_per_token(cfg: K3Config, kv_cache_dtype: str = "bfloat16") -> int:
    """MLA latent-cache bytes per token over all MLA layers (576 values per layer for K3)."""
    return cfg.layer_types.count(MLA) * cfg.mla_cache_width * _bytes(kv_cache_dtype)


def kda_state_bytes_per_sequence(cfg: K3Config, *, tensor_parallel: int = 1,
                                 conv_dtype: str = "bfloat16") -> int:
    """Bytes of one sequence's KDA state on one rank: fp32 recurrent state plus the conv window."""
    if cfg.kda_num_heads % tensor_parallel:
        raise ValueError(f"{cfg.kda_num_heads} KDA heads do not divide over tensor_parallel={tensor_parallel}")
    heads = cfg.kda_num_heads // tensor_parallel
    recurrent = heads * cfg.kda_head_dim * cfg.kda_head_dim * 4
    conv = 3 * heads * cfg.kda_head_dim * (cfg.kda_conv_size - 1) * _bytes(conv_dtype)
    return cfg.layer_types.count(KDA) * (recurrent + conv)


def _bytes(dtype: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown cache dtype {dtype!r}; choose one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]

