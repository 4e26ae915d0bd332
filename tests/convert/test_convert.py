"""python -m convert: Orbax round trips, atomic output, verification, errors; synthetic extras."""

import base64
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open

import k3jax
from convert import synth
from convert.__main__ import main as convert_main
from convert.converter import convert_checkpoint, verify_checkpoint
from convert.reader import CheckpointError
from tests.k3jax.tiny_configs import KIMI_LINEAR_TINY, k3_tiny_dict

IDS = np.array([[5, 300, 17, 258, 99, 7, 64, 1]], np.int32)


@pytest.fixture(scope="module")
def k3_src(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    synth.write_checkpoint(d, k3_tiny_dict(), seed=3, shard_bytes=150_000)
    return d


@pytest.mark.parametrize("which", ["k3-tiny", "kimi-linear-tiny"])
def test_orbax_round_trip_gives_the_same_logits(tmp_path, which):
    src = tmp_path / "src"
    synth.write_checkpoint(src, k3_tiny_dict() if which == "k3-tiny" else KIMI_LINEAR_TINY, seed=4)
    manifest = convert_checkpoint(src, tmp_path / "out", dtype="float32", verify=True)
    assert manifest["items"]["layer_00000"] and manifest["source_tensors"]
    ids = IDS % (512 if which == "k3-tiny" else 256)
    direct = k3jax.from_pretrained(src, dtype="float32")
    converted = k3jax.from_pretrained(tmp_path / "out", dtype="float32")
    np.testing.assert_array_equal(converted.logits(ids), direct.logits(ids))
    if which == "k3-tiny":  # the vision tower is converted too
        assert "vision" in manifest["items"]
        image = direct.vision.prepare(Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 50, 3), np.uint8)))
        np.testing.assert_array_equal(converted.vision.encode(image), direct.vision.encode(image))
    else:
        assert converted.vision is None and direct.vision is None and "vision" not in manifest["items"]
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_output_carries_config_tokenizer_and_manifest(k3_src, tmp_path):
    out = tmp_path / "out"
    manifest = convert_checkpoint(k3_src, out)
    for name in ("config.json", "tiktoken.model", "tokenizer_config.json", "manifest.json"):
        assert (out / name).exists(), name
    packed = manifest["items"]["layer_00001"]["block_sparse_moe/experts/w1/packed"]
    assert packed["dtype"] == "uint8" and packed["shape"] == [16, 32, 16]  # MXFP4 stays packed, stacked [E, ...]
    assert manifest["items"]["layer_00001"]["self_attn/q_proj/kernel"]["dtype"] == "bfloat16"
    assert manifest["items"]["layer_00001"]["self_attn/A_log"]["dtype"] == "float32"  # gate params stay fp32
    # The checksum is of the bytes as stored (the embedding is bf16 in the source and stays so).
    index = json.loads((k3_src / "model.safetensors.index.json").read_text())
    name = "language_model.model.embed_tokens.weight"
    with safe_open(k3_src / index["weight_map"][name], framework="numpy") as f:
        source_bytes = f.get_tensor(name).tobytes()
    assert manifest["items"]["model.embed_tokens"]["embed_tokens"]["sha256"] == hashlib.sha256(source_bytes).hexdigest()


def test_destination_not_empty_needs_overwrite(k3_src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty; pass --overwrite"):
        convert_checkpoint(k3_src, out)
    assert (out / "keep.txt").read_text() == "mine"
    convert_checkpoint(k3_src, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "manifest.json").exists()


def test_failed_conversion_leaves_nothing(k3_src, tmp_path):
    src = tmp_path / "broken"
    src.mkdir()
    for f in k3_src.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    last_shard = index["weight_map"]["language_model.model.layers.9.self_attn.o_proj.weight"]
    data = (src / last_shard).read_bytes()
    (src / last_shard).write_bytes(data[: len(data) // 2])  # truncated shard
    with pytest.raises(CheckpointError, match=last_shard):
        convert_checkpoint(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def test_an_older_converted_format_is_refused_by_name(k3_src, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(k3_src, out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "format": "k3jax-orbax-v1"}))
    with pytest.raises(CheckpointError, match="format 'k3jax-orbax-v1'.*run python -m convert"):
        k3jax.from_pretrained(out)


def test_verify_detects_a_changed_array(k3_src, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(k3_src, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["items"]["layer_00002"]["self_attn/dt_bias"]["sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="layer_00002/self_attn/dt_bias does not match"):
        verify_checkpoint(out)


def test_cli_reports_errors_without_a_traceback(k3_src, tmp_path, capsys):
    assert convert_main(["--src", str(tmp_path / "missing"), "--dst", str(tmp_path / "o")]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert convert_main(["--src", str(k3_src), "--dst", str(tmp_path / "o"), "--verify"]) == 0
    assert "converted in" in capsys.readouterr().err


def test_index_naming_a_missing_file(k3_src, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in k3_src.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    shard = sorted(p for p in src.iterdir() if p.suffix == ".safetensors")[0]
    shard.rename(src / "gone.bin")
    with pytest.raises(CheckpointError, match=f"shard files that do not exist: .*{shard.name}"):
        k3jax.from_pretrained(src)


def test_synthetic_tokenizer_loads_in_tiktoken(k3_src):
    tiktoken = pytest.importorskip("tiktoken")  # a declared test dependency
    ranks = {}
    for line in (k3_src / "tiktoken.model").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    config = json.loads((k3_src / "tokenizer_config.json").read_text())
    specials = {v["content"]: int(k) for k, v in config["added_tokens_decoder"].items()}
    enc = tiktoken.Encoding("k3-tiny", pat_str=r"[\s\S]", mergeable_ranks=ranks, special_tokens=specials)
    text = "héllo <|open|>think<|sep|>"
    ids = enc.encode(text, allowed_special="all")
    assert ids[-3:] == [specials["<|open|>"], *enc.encode("think"), specials["<|sep|>"]][-3:]
    assert enc.decode(ids) == text
    assert specials["[BOS]"] == 256 and specials["[EOS]"] == 258 and specials["<|media_pad|>"] == 277
    cfg = k3jax.K3Config.from_pretrained(k3_src)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.media_placeholder_token_id) == (256, 258, 277)
    assert config["eos_token"] == "[EOS]"


def test_sharded_restore_on_16_devices(k3_src, tmp_path):
    """8x2 mesh on 16 fake CPU devices: every parameter on the mesh with the sharding of the table,
    values equal to the unsharded load, from safetensors and from Orbax."""
    out = tmp_path / "out"
    convert_checkpoint(k3_src, out, dtype="float32")
    script = f"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=16"
import jax, numpy as np
import k3jax
ids = np.array({np.concatenate([IDS, IDS[:, ::-1]]).tolist()}, np.int32)  # a batch divisible by data=2
reference = k3jax.from_pretrained({str(k3_src)!r}, dtype="float32")
for path in ({str(k3_src)!r}, {str(out)!r}):
    model = k3jax.from_pretrained(path, dtype="float32", mesh="8x2")
    leaves = jax.tree.leaves(model.params)
    assert all(len(x.sharding.device_set) == 16 for x in leaves), "not on the mesh"
    for a, b in zip(leaves, jax.tree.leaves(reference.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = reference.logits(ids)
    np.testing.assert_allclose(model.logits(ids), want, rtol=0, atol=5e-5 * np.abs(want).max())
try:
    k3jax.from_pretrained({str(k3_src)!r}, mesh="8x4")
except ValueError as e:
    assert "needs 32 devices, found 16" in str(e), e
else:
    raise AssertionError("8x4 should not fit")
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
