"""K3Config parsing, presets and validation."""

import copy
import json

import pytest

from k3jax.config import DENSE, KDA, MLA, MOE, ConfigError, K3Config
from k3jax.presets import KIMI_K3_TEXT, KIMI_LINEAR_48B, PRESETS


def test_kimi_k3_preset_has_the_published_numbers():
    c = K3Config.from_preset("kimi-k3")
    assert c.model_type == "kimi_k3"
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size) == (7168, 93, 163840)
    mla = [i for i, t in enumerate(c.layer_types) if t == MLA]
    assert mla == list(range(3, 92, 4)) + [92]
    assert c.layer_types.count(KDA) == 69
    assert c.mlp_layer_types[0] == DENSE and set(c.mlp_layer_types[1:]) == {MOE}
    assert c.experts_mxfp4 and c.latent_moe and c.attn_res
    assert c.num_attn_res_blocks == 8
    assert (c.kda_num_heads, c.kda_head_dim, c.kda_gate_lower_bound, c.kda_full_rank_gate) == (96, 128, -5.0, True)
    assert c.kda_output_norm_eps == 1e-5
    assert c.mla_cache_width == 576


def test_kimi_linear_published_and_transformers_forms_agree():
    published = K3Config.from_hf_dict(KIMI_LINEAR_48B)
    assert [i + 1 for i, t in enumerate(published.layer_types) if t == MLA] == [4, 8, 12, 16, 20, 24, 27]
    assert published.kda_gate_lower_bound is None and not published.kda_full_rank_gate
    assert not published.attn_res and not published.latent_moe and not published.experts_mxfp4
    assert published.q_lora_rank is None
    # transformers writes 0-indexed layer_types and the alias names
    saved = {k: v for k, v in KIMI_LINEAR_48B.items() if k not in ("linear_attn_config", "num_experts",
                                                                     "num_experts_per_token", "num_shared_experts",
                                                                     "num_expert_group", "moe_renormalize")}
    saved.update(
        layer_types=["full_attention" if t == MLA else "linear_attention" for t in published.layer_types],
        mlp_layer_types=["dense"] + ["sparse"] * 26,
        linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4,
        num_local_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=1, norm_topk_prob=True)
    assert K3Config.from_hf_dict(saved) == published


def test_k3_tiny_exercises_every_k3_feature():
    c = K3Config.from_preset("k3-tiny")
    assert c.layer_types.count(KDA) >= 3 and c.layer_types.count(MLA) >= 2
    assert c.layer_types[-1] == MLA and c.mlp_layer_types[0] == DENSE
    assert c.latent_moe and c.num_shared_experts and c.experts_mxfp4 and c.hidden_act == "situ"
    assert c.num_attn_res_blocks >= 3


def test_from_pretrained_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["k3-tiny"]))
    assert K3Config.from_pretrained(tmp_path) == K3Config.from_preset("k3-tiny")


def _text(**changes):
    text = copy.deepcopy(KIMI_K3_TEXT)
    for key, value in changes.items():
        if key.startswith("lac_"):
            text["linear_attn_config"][key[4:]] = value
        else:
            text[key] = value
    return {"model_type": "kimi_k3", "text_config": text}


@pytest.mark.parametrize("changes, message", [
    (dict(lac_kda_layers=KIMI_K3_TEXT["linear_attn_config"]["kda_layers"][1:]), r"do not cover layers \[1\]"),
    (dict(lac_kda_layers=[0] + list(range(1, 93))), "1-indexed"),
    (dict(lac_full_attn_layers=[4, 8, 93, 5]), "in both"),
    (dict(routed_expert_hidden_size=3580), "MXFP4 group size 32 does not divide routed_expert_hidden_size"),
    (dict(moe_intermediate_size=3000), "moe_intermediate_size=3000"),
    (dict(num_experts=897), "num_experts=897"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(activation_situ_beta=None), "activation_situ_beta"),
    (dict(num_experts_per_token=1000), "num_experts_per_token"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(lac_gate_lower_bound=1.0), "gate_lower_bound"),
])
def test_bad_configs_name_the_key(changes, message):
    if "num_experts" in changes and changes["num_experts"] == 897:
        changes["num_expert_group"] = 2
    with pytest.raises(ConfigError, match=message):
        K3Config.from_hf_dict(_text(**changes))


def test_layer_types_and_lists_must_agree():
    d = copy.deepcopy(KIMI_LINEAR_48B)
    d["layer_types"] = ["linear_attention"] * 27
    with pytest.raises(ConfigError, match="disagree"):
        K3Config.from_hf_dict(d)


def test_unknown_model_type_and_preset():
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        K3Config.from_hf_dict({"model_type": "llama"})
    with pytest.raises(ConfigError, match="unknown preset"):
        K3Config.from_preset("kimi-k4")
