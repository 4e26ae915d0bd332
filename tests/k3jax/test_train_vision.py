"""The vision stage of k3jax.train at test sizes: its training rows are the serving prompt plus the
reply, a few steps lower the caption loss below its start, the trained tower exported beside the
text tensors loads back (convert.export -> the loader) with the trained outputs, and the text model
it starts from is the shipped one as served."""

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
    image, colour, shape = vision.draw(np.random.default_rng(0))
    for thinking in (False, True):
        ex = vision.example(tokenizer, ImageProcessorConfig(), image, "What is this?", f"{colour} {shape}", thinking)
        user = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "What is this?"}]}]
        served = chat_prompt(tokenize_messages(tokenizer, user, thinking=thinking), user, tokenizer,
                             ImageProcessorConfig())  # what the server and LLM.chat build
        assert ex.ids[:ex.reply_start].tolist() == served.ids and ex.pad_start == served.spans[0].start
        reply = tokenizer.decode(ex.ids[ex.reply_start:].tolist())
        assert f"A {colour} {shape}." in reply and (f"The image shows a {colour} {shape}." in reply) == thinking


def test_draw_paints_the_named_colour():
    rng = np.random.default_rng(1)
    for _ in range(20):
        image, colour, _ = vision.draw(rng)
        pixels = np.asarray(image).reshape(-1, 3)
        assert (pixels == vision.COLOURS[colour]).all(-1).mean() > 0.05  # the shape covers part of the image


@pytest.mark.slow  # compiling the backward pass of the text model and the tower
def test_training_lowers_the_caption_loss_and_the_export_loads_the_trained_tower(setup, tmp_path):
    cfg, tokenizer, vcfg = setup
    graphdef, params = nnx.split(K3Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    stream = vision.Stream(tokenizer, vcfg, ImageProcessorConfig(), seed=0)
    fixed = stream(4, False)  # one batch, seen at every step: its loss must fall
    rows = corpus.Batches(corpus.conversations(False)[:8], tokenizer, 64, seed=0)
    options = vision.VisionOptions(steps=6, batch=4, thinking_every=100, text_rows=1, warmup=1, tower_lr=1e-2)
    _, tower, text, history = vision.train(graphdef, params, vcfg, lambda size, thinking: fixed, rows, options,
                                           log=None)
    losses = history["caption_loss"]
    assert losses[-1] < 0.8 * losses[0], losses

    flat = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(text)}
    export.write_checkpoint(tmp_path, small_hf(), flat)
    tokens = np.random.default_rng(3).integers(0, 256, (1, 40)).astype(np.int32)
    text_only = k3jax.from_pretrained(tmp_path, dtype="float32")
    assert text_only.vision is None
    trained = vision.tower_arrays(tower)
    export.add_vision_tensors(tmp_path, vcfg, trained)
    loaded = k3jax.from_pretrained(tmp_path, dtype="float32")
    np.testing.assert_array_equal(loaded.logits(tokens), text_only.logits(tokens))  # the text tensors as they were
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
