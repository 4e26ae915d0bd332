"""Checkpoints in the published layout load through from_pretrained; bad checkpoints are named."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import k3jax
from convert import layout, synth
from convert.reader import CheckpointError
from tests.k3jax.tiny_configs import KIMI_LINEAR_TINY, k3_tiny_dict


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3tiny")
    synth.write_checkpoint(d, k3_tiny_dict(), seed=1, shard_bytes=200_000)
    return d


def _param(model, layer, *path):
    """A layer's parameter value."""
    node = model.params["layers"][layer]
    for p in path:
        node = node[p]
    return np.asarray(node[...])


def test_synthetic_k3_checkpoint_has_the_published_layout(k3_dir):
    index = json.loads((k3_dir / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    p = "language_model.model.layers."
    assert f"{p}0.mlp.gate_proj.weight" in names and f"{p}1.block_sparse_moe.experts.15.w2.weight_scale" in names
    assert f"{p}3.self_attn.kv_a_proj_with_mqa.weight" in names and "language_model.lm_head.weight" in names
    assert f"{p}4.self_attention_res_proj.weight" in names
    shard = load_file(str(k3_dir / index["weight_map"][f"{p}1.block_sparse_moe.experts.0.w1.weight_packed"]))
    packed = shard[f"{p}1.block_sparse_moe.experts.0.w1.weight_packed"]
    assert packed.dtype == np.uint8 and packed.shape == (32, 16)  # [moe_intermediate, latent / 2]
    assert json.loads((k3_dir / "config.json").read_text())["text_config"]["quantization_config"]["format"] == \
        "mxfp4-pack-quantized"


def test_k3_checkpoint_loads_and_places_every_tensor(k3_dir):
    model = k3jax.from_pretrained(k3_dir, dtype="float32")
    logits = model.logits(np.arange(12, dtype=np.int32)[None] * 37 % 512)
    assert np.isfinite(logits).all() and logits.std() > 1e-2
    p = "language_model.model.layers."
    tensors = {}
    for f in k3_dir.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    np.testing.assert_array_equal(_param(model, 5, "self_attn", "q_proj", "kernel"),
                                  tensors[f"{p}5.self_attn.q_proj.weight"].astype(np.float32))
    np.testing.assert_array_equal(_param(model, 9, "block_sparse_moe", "experts", "w2", "packed")[3],
                                  tensors[f"{p}9.block_sparse_moe.experts.3.w2.weight_packed"])
    a_log = tensors[f"{p}2.self_attn.A_log"]
    assert a_log.shape == (16,)  # stored head_dim long; the first num_heads entries are used
    np.testing.assert_array_equal(_param(model, 2, "self_attn", "A_log"), a_log[:8])
    np.testing.assert_array_equal(_param(model, 6, "self_attn", "k_conv1d"),
                                  tensors[f"{p}6.self_attn.k_conv1d.weight"][:, 0, :].T)
    np.testing.assert_array_equal(_param(model, 4, "mlp_res", "proj"),
                                  tensors[f"{p}4.mlp_res_proj.weight"].astype(np.float32)[0])
    assert model.params["layers"][1]["block_sparse_moe"]["experts"]["w1"]["packed"][...].dtype == \
        np.uint8  # experts stay MXFP4


def _rewrite(src, dst, edit):
    """Copies a single-file checkpoint through `edit(tensors) -> tensors`."""
    dst.mkdir()
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    save_file(edit(tensors), str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_alias_prefix_and_vision_tensors_are_accepted(k3_dir, tmp_path):
    def alias(t):
        return {k.replace("language_model.model.layers.", "language_model.layers."): v for k, v in t.items()}

    def text_only(t):
        return {k: v for k, v in t.items() if not k.startswith(("vision_tower.", "mm_projector."))}

    ids = np.arange(6, dtype=np.int32)[None]
    reference = k3jax.from_pretrained(k3_dir, dtype="float32")
    assert reference.vision is not None and reference.vision.config.num_layers == 2  # k3-tiny's tower
    aliased = k3jax.from_pretrained(_rewrite(k3_dir, tmp_path / "alias", alias), dtype="float32")
    np.testing.assert_array_equal(aliased.logits(ids), reference.logits(ids))
    text = k3jax.from_pretrained(_rewrite(k3_dir, tmp_path / "text", text_only), dtype="float32")
    assert text.vision is None  # no vision tensors: the text model alone, as before
    np.testing.assert_array_equal(text.logits(ids), reference.logits(ids))


@pytest.mark.parametrize("edit, message", [
    (lambda t: {k: v for k, v in t.items() if not k.endswith("layers.3.self_attn.q_b_proj.weight")},
     "no tensor 'language_model.model.layers.3.self_attn.q_b_proj.weight'"),
    (lambda t: {**t, "language_model.model.layers.2.self_attn.o_proj.weight": np.zeros((3, 3), np.float32)},
     r"layers.2.self_attn.o_proj.weight has shape \(3, 3\), expected \(64, 128\)"),
    (lambda t: {**t, "language_model.model.layers.1.self_attn.surprise.weight": np.zeros(2, np.float32)},
     "match no parameter"),
    (lambda t: {**t, "language_model.model.layers.4.self_attn.dt_bias": np.zeros(128, np.int32)},
     "layers.4.self_attn.dt_bias has dtype int32, expected a float type"),
    (lambda t: {**t, "language_model.model.layers.5.block_sparse_moe.experts.2.w3.weight_scale":
                np.zeros((32, 1), np.float32)},
     "experts.2.w3.weight_scale has dtype float32, expected uint8"),
])
def test_bad_checkpoints_name_the_tensor(k3_dir, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        k3jax.from_pretrained(_rewrite(k3_dir, tmp_path / "bad", edit))


def test_missing_directory_or_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        k3jax.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(KIMI_LINEAR_TINY))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        k3jax.from_pretrained(tmp_path)


def test_kimi_linear_layout_round_trips(tmp_path):
    cfg = synth.write_checkpoint(tmp_path, KIMI_LINEAR_TINY, seed=2)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert names == set(layout.all_tensors(cfg))
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names and "lm_head.weight" in names
    assert "model.layers.0.self_attn.g_a_proj.weight" in names  # low-rank output gate
    model = k3jax.from_pretrained(tmp_path, dtype="float32")
    assert np.isfinite(model.logits([[1, 2, 3, 4]])).all()
