"""Draft checkpoints: `python -m convert.synth --preset k3-tiny-dspark` -> load_draft gives back the
written tensors (the confidence kernel transposed); the `model.` prefix, shards and ignored embed/lm_head tensors are
accepted; missing, unexpected or misshapen tensors are errors naming them; the synthetic draft gives
logits of the target head's scale."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from convert import synth
from convert.reader import CheckpointError
from k3jax.config import ConfigError, K3Config
from k3jax.dspark import model as dd
from k3jax.dspark.config import DSparkConfig
from k3jax.dspark.loading import load_draft
from k3jax.presets import DRAFT_PRESETS
from sharding.mesh import make_mesh

TARGET = K3Config.from_preset("k3-tiny")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    synth.main(["--preset", "k3-tiny-dspark", "--out", str(d), "--seed", "3"])
    return d


def checkpoint_tensors(directory) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update({k: np.asarray(v, np.float32) for k, v in load_file(f).items()})
    return out


def hf_name(path) -> str:
    """The checkpoint name of a parameter path, written out independently of the loader's table."""
    *module, leaf = map(str, path)
    if module == [] and leaf.startswith("markov_"):
        return f"markov_head.{leaf}.weight"
    if leaf == "confidence_kernel":
        return "confidence_head.proj.weight"
    if leaf == "confidence_bias":
        return "confidence_head.proj.bias"
    return ".".join(module) + ".weight"


def assert_loaded_equals(model, tensors):
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    names = set()
    for path, v in flat:
        name = hf_name(path)
        names.add(name)
        want = tensors[name].T if path[-1] == "confidence_kernel" else tensors[name]
        np.testing.assert_array_equal(np.asarray(v.get_value(), np.float32), want, err_msg=name)
    assert names == {n for n in tensors if not n.startswith(("embed_tokens", "lm_head"))}


def test_round_trip(draft_dir):
    cfg, model = load_draft(draft_dir, TARGET, dtype="float32")
    assert cfg == DSparkConfig.from_pretrained(draft_dir)
    tensors = checkpoint_tensors(draft_dir)
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    # shapes as the published draft has them
    assert tensors["context_proj.weight"].shape == (h, cfg.target_hidden_size * cfg.num_target_layers)
    assert tensors["layers.1.self_attn.q_b_proj.weight"].shape == (heads * cfg.qk_head_dim, cfg.q_lora_rank)
    assert tensors["layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
    assert tensors["layers.0.self_attn.kv_b_proj.weight"].shape == (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                                                     cfg.kv_lora_rank)
    assert tensors["markov_head.markov_w2.weight"].shape == (cfg.vocab_size, cfg.markov_rank)
    assert_loaded_equals(model, tensors)


def rewrite(src, dst, tensors, config=None):
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config or json.loads((src / "config.json").read_text())))


def test_prefix_shards_and_ignored_tensors(draft_dir, tmp_path):
    tensors = checkpoint_tensors(draft_dir)
    v, h = TARGET.vocab_size, TARGET.hidden_size
    prefixed = {f"model.{k}": val for k, val in tensors.items()}
    prefixed["model.embed_tokens.weight"] = np.zeros((v, h), np.float32)
    prefixed["lm_head.weight"] = np.zeros((v, h), np.float32)
    rewrite(draft_dir, tmp_path / "prefixed", prefixed)
    _, model = load_draft(tmp_path / "prefixed", TARGET, dtype="float32")
    assert_loaded_equals(model, tensors)

    sharded = tmp_path / "sharded"
    synth.write_draft_checkpoint(sharded, DRAFT_PRESETS["k3-tiny-dspark"], seed=3, shard_bytes=20_000)
    assert (sharded / "model.safetensors.index.json").exists()
    _, model = load_draft(sharded, TARGET, dtype="float32")
    assert_loaded_equals(model, tensors)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("layers.1.mlp.up_proj.weight"), "layers.1.mlp.up_proj.weight"),
    (lambda t: t.pop("markov_head.markov_w1.weight"), "markov_head.markov_w1.weight"),
    (lambda t: t.update({"layers.0.self_attn.o_proj.weight": np.zeros((3, 4), np.float32)}),
     r"layers.0.self_attn.o_proj.weight.*\(3, 4\).*\(64, 128\)"),
    (lambda t: t.update({"layers.2.input_layernorm.weight": np.ones(64, np.float32)}), "layers.2.input_layernorm"),
    (lambda t: t.update({"confidence_head.proj.weight": np.ones((1, 64), np.float32)}), None),
])
def test_bad_tensors_are_named(draft_dir, tmp_path, change, message):
    tensors = checkpoint_tensors(draft_dir)
    change(tensors)
    rewrite(draft_dir, tmp_path / "bad", tensors)
    if message is None:  # a disabled confidence head's tensors are training-only: ignored
        load_draft(tmp_path / "bad", TARGET, dtype="float32")
        return
    with pytest.raises(CheckpointError, match=message):
        load_draft(tmp_path / "bad", TARGET, dtype="float32")


def test_confidence_head_and_target_check(tmp_path):
    config = {**DRAFT_PRESETS["k3-tiny-dspark"], "enable_confidence_head": True, "confidence_head_with_markov": True}
    synth.write_draft_checkpoint(tmp_path / "conf", config, seed=1)
    cfg, model = load_draft(tmp_path / "conf", TARGET, dtype="bfloat16")
    tensors = checkpoint_tensors(tmp_path / "conf")
    assert tensors["confidence_head.proj.weight"].shape == (1, cfg.hidden_size + cfg.markov_rank)
    assert model.confidence_kernel.dtype == jnp.float32 and model.final_norm.weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(model.confidence_bias[...]), tensors["confidence_head.proj.bias"])
    with pytest.raises(ConfigError, match="vocab"):
        load_draft(tmp_path / "conf", TARGET.replace(vocab_size=1024), dtype="float32")


def test_mesh_placement(draft_dir):
    mesh = make_mesh("8x2")
    _, model = load_draft(draft_dir, TARGET, dtype="float32", mesh=mesh)
    q_b = model.layers[0].self_attn.q_b_proj.kernel[...]
    assert q_b.sharding.spec == jax.sharding.PartitionSpec("model", None)
    assert model.markov_w2[...].sharding.spec == jax.sharding.PartitionSpec("model", None)


def test_synthetic_draft_logits_are_non_degenerate(draft_dir, tmp_path):
    """Through the synthetic k3-tiny target's head, the draft's logits have the scale that unit-RMS
    hidden states give through the same head, and its drafts vary with the inputs."""
    synth.main(["--preset", "k3-tiny", "--out", str(tmp_path / "target")])
    target = checkpoint_tensors(tmp_path / "target")
    head = dd.SharedHead(jnp.asarray(target["language_model.model.embed_tokens.weight"]),
                         jnp.asarray(target["language_model.lm_head.weight"]), 1.0)
    cfg, model = load_draft(draft_dir, TARGET, dtype="float32")
    rng = np.random.default_rng(0)
    n, t, page_size = 4, 8, 4
    table = np.arange(1, 1 + n * 4, dtype=np.int32).reshape(n, 4)
    pages = dd.init_draft_pages(cfg, 1 + n * 4, page_size, jnp.float32)
    taps = jnp.asarray(rng.standard_normal((n, t, cfg.context_width)), jnp.float32)
    pages = dd.inject_context(model, pages, taps, jnp.ones((n, t), bool), jnp.zeros(n, jnp.int32), jnp.asarray(table))
    bonus = jnp.asarray(rng.integers(0, 256, n), jnp.int32)
    drafts, logits, _ = dd.propose(model, pages, bonus, jnp.full(n, t, jnp.int32), jnp.asarray(table), head,
                                   temperature=jnp.zeros(n), keys=jax.random.split(jax.random.key(0), n),
                                   greedy_only=True)
    unit = np.asarray(head.logits(jnp.asarray(rng.standard_normal((64, cfg.hidden_size)), jnp.float32)))
    ratio = np.std(np.asarray(logits)) / np.std(unit)
    assert 0.3 < ratio < 3, ratio
    probs = jax.nn.softmax(logits, axis=-1)
    assert float(jnp.max(probs)) < 0.99
    assert len(np.unique(np.asarray(drafts))) > cfg.block_size
