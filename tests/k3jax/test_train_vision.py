"""The vision stage of k3jax.train at test sizes: its training rows are the serving prompt plus the
reply, a few steps lower the caption loss below its start with the text model frozen, the trained
tower exported beside the text tensors loads back (convert.export -> the loader) with the trained
outputs and the text tensors byte for byte, and the text model it starts from is the shipped one as
served; the shipped k3-tiny carries the stage's tower and report."""

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from PIL import Image

import k3jax
from convert import export
from k3jax.decoder import K3Transformer
from k3jax.model import K3Model
from k3jax.presets import PRESETS
from k3jax.train import corpus, target, vision
from k3jax.train.__main__ import text_tensors
from k3jax.vision.config import ImageProcessorConfig, vision_config
from k3jax.vision.encoder import encoder_from_arrays
from serve.chat.encoding import tokenize_messages
from serve.llm import default_model_dir
from serve.multimodal import chat_prompt
from tests.k3jax.test_train import small_hf


@pytest.fixture(scope="module")
def setup():
    cfg = target.training_config(small_hf())
    tokenizer = corpus.byte_tokenizer(cfg)
    return cfg, tokenizer, vision_config(cfg)


def test_a_training_row_is_the_served_prompt_then_the_reply(setup):
    cfg, tokenizer, vcfg = setup
    image, colour, _ = vision.draw(np.random.default_rng(0))
    for thinking in (False, True):
        ex = vision.example(tokenizer, ImageProcessorConfig(), image, "What is this?", colour, thinking)
        user = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "What is this?"}]}]
        served = chat_prompt(tokenize_messages(tokenizer, user, thinking=thinking), user, tokenizer,
                             ImageProcessorConfig())  # what the server and LLM.chat build
        assert ex.ids[:ex.reply_start].tolist() == served.ids and ex.pad_start == served.spans[0].start
        reply = tokenizer.decode(ex.ids[ex.reply_start:].tolist())
        assert f"A {colour} shape." in reply and (f"The image shows a {colour} shape." in reply) == thinking
        assert tokenizer.decode(ex.ids[slice(*ex.caption)].tolist()) == colour  # the response's colour word
        assert tokenizer.decode(ex.ids[ex.caption[1]:].tolist()).startswith(" shape.<|close|>response")


def test_draw_paints_the_named_colour():
    rng = np.random.default_rng(1)
    for _ in range(20):
        image, colour, _ = vision.draw(rng)
        pixels = np.asarray(image).reshape(-1, 3)
        assert (pixels == vision.COLOURS[colour]).all(-1).mean() > 0.05  # the shape covers part of the image


@pytest.mark.slow  # compiling the backward pass through the text model to the tower
def test_training_lowers_the_caption_loss_and_the_export_loads_the_trained_tower(setup, tmp_path):
    cfg, tokenizer, vcfg = setup
    graphdef, params = nnx.split(K3Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    before = {k: np.asarray(v.get_value()).copy() for k, v in nnx.to_flat_state(params)}
    stream = vision.Stream(tokenizer, vcfg, ImageProcessorConfig(), seed=0)
    fixed = stream(4)  # one batch, seen at every step: its loss must fall
    options = vision.VisionOptions(steps=6, batch=4, warmup=1, lr=3e-2)
    _, tower, history = vision.train(graphdef, params, vcfg, lambda size: fixed, options, log=None)
    # through a frozen random text model the tower's few embeddings move the loss slowly (6.59 -> 6.49),
    # but every step lowers it (step 0 learns at the warm-up's rate 0)
    losses = history["caption_loss"]
    assert all(b < a for a, b in zip(losses[1:], losses[2:])) and losses[-1] < losses[0] - 0.05, losses
    for k, v in nnx.to_flat_state(params):  # the text model is frozen
        np.testing.assert_array_equal(np.asarray(v.get_value()), before[k])

    export.write_checkpoint(tmp_path, small_hf(), before)
    tokens = np.random.default_rng(3).integers(0, 256, (1, 40)).astype(np.int32)
    text_only = k3jax.from_pretrained(tmp_path, dtype="float32")
    assert text_only.vision is None
    stored = text_tensors(tmp_path)
    trained = vision.tower_arrays(tower)
    export.add_vision_tensors(tmp_path, vcfg, trained)
    assert text_tensors(tmp_path) == stored  # the text tensors byte for byte
    loaded = k3jax.from_pretrained(tmp_path, dtype="float32")
    np.testing.assert_array_equal(loaded.logits(tokens), text_only.logits(tokens))
    assert loaded.vision is not None and k3jax.from_pretrained(tmp_path, dtype="float32", vision=False).vision is None
    # the checkpoint stores bf16: the trained tower with exactly that rounding, run by the same encoder
    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in trained.items()}
    reference = encoder_from_arrays(vcfg, ImageProcessorConfig(), rounded, dtype="float32")
    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (84, 112, 3), np.uint8))
    np.testing.assert_array_equal(loaded.vision.encode(image), reference.encode(image))


def test_pretrained_decodes_the_shipped_checkpoint_to_the_served_model():
    """The vision stage's starting point: the shipped k3-tiny with plain fp32 experts computes the
    served model's (MXFP4 experts) logits exactly."""
    path = default_model_dir()
    cfg = target.training_config(PRESETS["k3-tiny"])
    graphdef, params = target.pretrained(path, cfg)
    tokens = np.random.default_rng(4).integers(0, 256, (1, 48)).astype(np.int32)
    served = k3jax.from_pretrained(path, dtype="float32")
    np.testing.assert_array_equal(K3Model(cfg, graphdef, params).logits(tokens), served.logits(tokens))


def test_the_shipped_k3_tiny_has_the_vision_stages_tower_and_report():
    """`make weights` ends with the vision stage: the embedded checkpoint carries its tower (what
    `make serve` encodes images with) and training.json its figures, caption accuracy against chance
    included."""
    path = default_model_dir()
    model = k3jax.from_pretrained(path, dtype="float32")
    assert model.vision is not None and model.vision.config == vision_config(model.config)
    with open(os.path.join(path, "training.json")) as f:
        report = json.load(f)
    accuracy = report["vision"]["caption_accuracy"]
    assert accuracy["chance_colour"] == 1 / len(vision.COLOURS) and accuracy["images"] == report["vision"]["options"][
        "held_out"]
    assert len(report["vision"]["caption_loss"]) == report["vision"]["options"]["steps"]
