"""DSparkConfig: the draft config.json keys, their aliases and defaults, and errors naming the bad key;
check_target against the target K3Config."""

import json

import pytest

from k3jax.config import ConfigError, K3Config
from k3jax.dspark.config import DSparkConfig
from k3jax.presets import DRAFT_PRESETS, DRAFT_TARGETS


def base() -> dict:
    return json.loads(json.dumps(DRAFT_PRESETS["k3-tiny-dspark"]))


def test_preset_reads_every_key():
    d = base()
    cfg = DSparkConfig.from_dict(d)
    assert cfg.target_layer_ids == tuple(d["target_layer_ids"])
    assert cfg.num_target_layers == len(d["target_layer_ids"])
    assert cfg.context_width == cfg.num_target_layers * d["target_hidden_size"]
    assert cfg.block_size == d["block_size"]
    assert cfg.mask_token_id == d["dflash_config"]["mask_token_id"]
    assert cfg.mla_cache_width == d["kv_lora_rank"] + d["qk_rope_head_dim"]
    assert cfg.qk_head_dim == d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    assert cfg.target_hidden_tap == "residual_sum"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                "markov_rank", "vocab_size", "rope_theta", "rms_norm_eps"):
        assert getattr(cfg, key) == d[key], key
    cfg.check_target(K3Config.from_preset(DRAFT_TARGETS["k3-tiny-dspark"]))


def test_aliases_and_defaults(tmp_path):
    d = base()
    del d["block_size"], d["dflash_config"], d["rope_theta"], d["logit_scale"], d["num_target_layers"]
    d["dspark_block_size"] = 5
    d["dspark_noise_token_id"] = 260
    d["target_hidden_tap"] = "next_mixture"
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = DSparkConfig.from_pretrained(tmp_path)
    assert (cfg.block_size, cfg.mask_token_id, cfg.rope_theta, cfg.logit_scale) == (5, 260, 50000.0, 1.0)
    assert cfg.target_hidden_tap == "next_mixture"
    del d["dspark_noise_token_id"]
    d["mask_token_id"] = 261
    assert DSparkConfig.from_dict(d).mask_token_id == 261


@pytest.mark.parametrize("change, key", [
    ({"mla_use_nope": True}, "mla_use_nope"),
    ({"mla_use_output_gate": True}, "mla_use_output_gate"),
    ({"mla_use_qk_norm": True}, "mla_use_qk_norm"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"num_target_layers": 2}, "num_target_layers"),
    ({"target_layer_ids": []}, "target_layer_ids"),
    ({"target_hidden_tap": "post_norm"}, "target_hidden_tap"),
    ({"sample_from_anchor": False}, "sample_from_anchor"),
    ({"dspark_bonus_anchor": True}, "dspark_bonus_anchor"),
    ({"draft_vocab_size": 100}, "draft_vocab_size"),
    ({"dspark_block_size": 3}, "dspark_block_size"),
    ({"block_size": 0}, "block_size"),
    ({"markov_rank": 0}, "markov_rank"),
    ({"dflash_config": {"mask_token_id": 512}}, "mask_token_id"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope_scaling"),
])
def test_bad_key_is_named(change, key):
    d = {**base(), **change}
    with pytest.raises(ConfigError, match=key):
        DSparkConfig.from_dict(d)


@pytest.mark.parametrize("key", ["q_lora_rank", "target_layer_ids", "hidden_size", "markov_rank"])
def test_missing_key_is_named(key):
    d = base()
    del d[key]
    with pytest.raises(ConfigError, match=key):
        DSparkConfig.from_dict(d)


def test_missing_mask_and_block():
    d = base()
    del d["dflash_config"]
    with pytest.raises(ConfigError, match="mask_token_id"):
        DSparkConfig.from_dict(d)
    d = base()
    del d["block_size"]
    with pytest.raises(ConfigError, match="block_size"):
        DSparkConfig.from_dict(d)


def test_check_target_errors():
    target = K3Config.from_preset("k3-tiny")
    cfg = DSparkConfig.from_dict(base())
    with pytest.raises(ConfigError, match="vocab"):
        cfg.check_target(target.replace(vocab_size=1024))
    with pytest.raises(ConfigError, match="target_hidden_size"):
        cfg.check_target(target.replace(hidden_size=128))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        DSparkConfig.from_dict({**base(), "target_layer_ids": [1, 4, 10]}).check_target(target)
