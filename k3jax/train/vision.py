"""The vision stage: trains k3-tiny's vision tower and projector (K3_TINY_VISION) against the frozen
text model, to say which colour an image shows.

The data are synthetic: one shape (SHAPES) of one colour (COLOURS) at a random place, filling much of
a grey background of a random level, drawn with Pillow at a random size of SIZES_PX (9 to 16 image
tokens). Each image becomes an instant-mode chat turn in K3's format, rendered and expanded by the
serving code itself (`serve.chat.encoding`, `serve.multimodal.expand_images`): the user sends the
image and asks what it shows (image or question first), the assistant answers "A red shape.". The
loss is the reply's next-token cross-entropy, the colour's word weighted CAPTION_WEIGHT; the tower's
outputs replace the `<|media_pad|>` embeddings.

The text model is frozen: it starts from the text stage's checkpoint as served (bf16, MXFP4 experts
decoded: `target.pretrained`), gradients reach only the tower and projector, and the shipped
checkpoint's text tensors are the text stage's byte for byte (`python -m k3jax.train` adds the tower
to them; the DSpark draft distilled from the text model and the benchmarks measured on it stay
valid). An earlier form of this stage tuned the text model beside the tower (a quarter of the text
stage's learning rate, corpus rows in every step; 0bfd99e): at its budget captions stayed at chance
and the text model's held-out perplexity rose 2.68 -> 2.75, so it never shipped.

The shipped tower exercises the image path but does not see. Its run (600 steps of 8 images, 514 s
on 2 cores; k3jax/weights/k3-tiny/training.json, "vision"): the colour word's loss fell from 4.41 to
4.06 nats (means of the first and last 50 steps) and the reply's from 2.27 to 2.11, but greedy
instant replies to 100 held-out images name no colour at all (`caption_accuracy`: 0.0 against chance
0.25): they are four of the text model's answers about Python. The text model's replies do not yet
depend on what the user's turn holds (README, "The embedded model"), so a few image embeddings in it
barely steer them. Still, the tower's output changes the greedy reply with the image (from the first
token in tests/serve/test_server.py), which is what it is shipped for.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from PIL import Image, ImageDraw

from k3jax.layers.ffn import training_moe
from k3jax.model import K3Model
from k3jax.vision.config import ImageProcessorConfig, VisionConfig
from k3jax.vision.tower import PatchLayout, VisionTower, patch_layout
from serve.chat.encoding import tokenize_messages
from serve.chat.parsing import parse_output
from serve.chat.tokenizer import Tokenizer
from serve.engine import Engine, EngineOptions
from serve.multimodal import ImageInput, expand_images
from serve.sampling import SamplingParams

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (240, 210, 20)}
SHAPES = ("circle", "square", "triangle", "cross")
SIZES_PX = (84, 112)  # each side: 3 or 4 merged 28-px tokens
QUESTIONS = ("What does this image show?", "What is in this picture?", "Describe the image.", "What do you see?")
MAX_PATCHES = (max(SIZES_PX) // 14) ** 2  # every image's patches padded to this: one compiled tower
ROW = 160  # tokens a row predicts (the longest conversation: 160 tokens, 159 targets)
# the loss weight of the colour's word (the rest of a reply: 1): it is what the image decides, and at
# weight 1 the reply's fixed markup dilutes it
CAPTION_WEIGHT = 4.0
HELD_OUT_SEED = 1 << 20  # the held-out images' stream, apart from every training seed


@dataclasses.dataclass(frozen=True)
class VisionOptions:
    steps: int = 600
    batch: int = 8
    lr: float = 3e-2  # a fresh tower
    warmup: int = 10
    weight_decay: float = 0.01
    seed: int = 0
    held_out: int = 100


def draw(rng: np.random.Generator) -> tuple[Image.Image, str, str]:
    """(image, colour, shape): one shape on a plain grey background, all of it drawn from `rng`."""
    width, height = (int(rng.choice(SIZES_PX)) for _ in range(2))
    colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
    image = Image.new("RGB", (width, height), (int(rng.integers(0, 256)),) * 3)
    canvas = ImageDraw.Draw(image)
    r = rng.uniform(0.3, 0.5) * min(width, height)  # half the shape's extent
    cx, cy = rng.uniform(r, width - r), rng.uniform(r, height - r)
    fill = COLOURS[colour]
    if shape == "circle":
        canvas.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        canvas.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "triangle":
        canvas.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        t = r / 3
        canvas.rectangle((cx - r, cy - t, cx + r, cy + t), fill=fill)
        canvas.rectangle((cx - t, cy - r, cx + t, cy + r), fill=fill)
    return image, colour, shape


def messages(image: Image.Image, question: str, colour: str | None = None, image_first: bool = True) -> list[dict]:
    """The user's turn (the image and the question, in either order) and, with a colour, the
    assistant's reply."""
    parts = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": question}]
    out = [{"role": "user", "content": parts if image_first else parts[::-1]}]
    if colour is not None:
        out.append({"role": "assistant", "reasoning_content": f"The image shows a {colour} shape.",
                    "content": f"A {colour} shape."})
    return out


@dataclasses.dataclass(frozen=True)
class Example:
    ids: np.ndarray  # int32: the whole conversation, the image's pads expanded
    reply_start: int  # where the assistant's generated tokens begin (the prompt's length)
    pad_start: int  # the first <|media_pad|> position
    image: ImageInput
    caption: tuple[int, int]  # [start, stop) of the colour's word in the reply's response channel


def example(tokenizer: Tokenizer, processor: ImageProcessorConfig, image: Image.Image, question: str,
            colour: str, thinking: bool = False, image_first: bool = True) -> Example:
    prepared = ImageInput.from_image(image, processor)
    convo = messages(image, question, colour, image_first)
    whole = expand_images(tokenize_messages(tokenizer, convo, thinking=thinking, add_generation_prompt=False),
                          [prepared], tokenizer)
    prompt = expand_images(tokenize_messages(tokenizer, convo[:1], thinking=thinking), [prepared], tokenizer)
    words = tokenizer.encode(f" {colour} shape.")  # as the reply's "A red shape." holds them (byte tokens)
    ids = np.asarray(whole.ids, np.int32)
    stop = max(i for i in range(len(prompt.ids), len(ids)) if ids[i - len(words):i].tolist() == words)
    start = stop - len(words) + 1
    return Example(ids, len(prompt.ids), whole.spans[0].start, prepared, (start, start + len(colour)))


def batch(cfg: VisionConfig, examples: list[Example], length: int = ROW):
    """Arrays of a training step: tokens [B, length + 1] (0-padded), reply weights [B, length], the
    patches [B, MAX_PATCHES, 3, p, p] with their PatchLayouts stacked, pads' start [B] and count [B]."""
    b = len(examples)
    tokens = np.zeros((b, length + 1), np.int32)
    weights = np.zeros((b, length), np.float32)
    pixels = np.zeros((b, MAX_PATCHES, 3, cfg.patch_size, cfg.patch_size), np.float32)
    layouts, starts, counts = [], np.zeros(b, np.int32), np.zeros(b, np.int32)
    for r, ex in enumerate(examples):
        if len(ex.ids) > length + 1:
            raise ValueError(f"a conversation of {len(ex.ids)} tokens does not fit a row of {length + 1}")
        tokens[r, :len(ex.ids)] = ex.ids
        weights[r, ex.reply_start - 1:len(ex.ids) - 1] = 1.0  # targets: the reply's tokens
        weights[r, ex.caption[0] - 1:ex.caption[1] - 1] = CAPTION_WEIGHT
        prepared = ex.image.prepared
        pixels[r, :prepared.num_patches] = prepared.pixel_values
        layouts.append(patch_layout(cfg, tuple(map(int, prepared.grid_hw)), MAX_PATCHES))
        starts[r], counts[r] = ex.pad_start, ex.image.num_tokens
    return tokens, weights, pixels, jax.tree.map(lambda *a: np.stack(a), *layouts), starts, counts


def image_embeddings(tower_graphdef, tower_params, pixels, layouts: PatchLayout, starts, counts, length: int):
    """The embeddings override of a batch: (values [B, length, H], mask [B, length]), each row's
    image tokens at its pads."""
    features = jax.vmap(lambda px, lay: nnx.merge(tower_graphdef, tower_params)(px, lay))(pixels, layouts)
    index = jnp.arange(length)[None] - starts[:, None]  # [B, T]: which image token each position is
    mask = (index >= 0) & (index < counts[:, None])
    values = jnp.take_along_axis(features, jnp.clip(index, 0, features.shape[1] - 1)[..., None], axis=1)
    return jnp.where(mask[..., None], values, 0.0), mask


def caption_loss(tower_params, text_params, tower_graphdef, text_graphdef, tokens, weights, pixels, layouts,
                 starts, counts):
    """The replies' weighted mean next-token cross-entropy with the tower's outputs at the pads, and
    (aux) the mean over the colours' words alone."""
    embeds = image_embeddings(tower_graphdef, tower_params, pixels, layouts, starts, counts, tokens.shape[1] - 1)
    with training_moe():  # the experts' differentiable path: gradients reach the pads through them
        logits = nnx.merge(text_graphdef, text_params).forward(tokens[:, :-1], embeds=embeds).logits
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    words = weights == CAPTION_WEIGHT
    return jnp.sum(weights * nll) / jnp.sum(weights), jnp.sum(jnp.where(words, nll, 0.0)) / jnp.sum(words)


class Stream:
    """Training batches drawn from a seeded stream of images and questions."""

    def __init__(self, tokenizer: Tokenizer, cfg: VisionConfig, processor: ImageProcessorConfig, seed: int):
        self.tokenizer, self.cfg, self.processor = tokenizer, cfg, processor
        self.rng = np.random.default_rng(seed)

    def __call__(self, size: int):
        examples = []
        for _ in range(size):
            image, colour, _ = draw(self.rng)
            question, image_first = str(self.rng.choice(QUESTIONS)), bool(self.rng.integers(2))
            examples.append(example(self.tokenizer, self.processor, image, question, colour, image_first=image_first))
        return batch(self.cfg, examples)


def train(text_graphdef, text_params, cfg: VisionConfig, images, options: VisionOptions, log=print):
    """Trains a fresh fp32 tower (seeded by options.seed) on `images(batch)` against the frozen text
    model (of a `training_config`, `target.pretrained`). Returns (tower graphdef, tower params,
    per-step losses: the replies' weighted loss and the colours' words alone)."""
    tower_graphdef, tower = nnx.split(VisionTower(cfg, dtype=jnp.float32, rngs=nnx.Rngs(options.seed)))
    warmup = min(options.warmup, options.steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, options.lr, warmup, options.steps, options.lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=options.weight_decay))

    @jax.jit
    def step(tower, state, text_params, arrays):
        (loss, word), grads = jax.value_and_grad(caption_loss, has_aux=True)(tower, text_params, tower_graphdef,
                                                                             text_graphdef, *arrays)
        updates, state = tx.update(grads, state, tower)
        return optax.apply_updates(tower, updates), state, loss, word

    state = tx.init(tower)
    history = {"caption_loss": [], "word_loss": []}
    for i in range(options.steps):
        tower, state, loss, word = step(tower, state, text_params, images(options.batch))
        history["caption_loss"].append(round(float(loss), 4))
        history["word_loss"].append(round(float(word), 4))
        if log and (i % 10 == 0 or i == options.steps - 1):
            log(f"vision step {i}: reply loss {loss:.3f}, colour word loss {word:.3f}")
    return tower_graphdef, tower, history


def tower_arrays(params) -> dict[tuple, np.ndarray]:
    """The tower's parameters by path, as `convert.export.vision_checkpoint_tensors` takes them."""
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}


def held_out(count: int, seed: int) -> list[tuple[Image.Image, str, str, str, bool]]:
    """(image, colour, shape, question, image first) of images drawn apart from every training stream."""
    rng = np.random.default_rng(HELD_OUT_SEED + seed)
    return [(*draw(rng), str(rng.choice(QUESTIONS)), bool(rng.integers(2))) for _ in range(count)]


def named(content: str, words) -> list[str]:
    """The words of `words` that `content` names, in the order they appear."""
    found = {w: content.lower().find(w) for w in words}
    return sorted((w for w in words if found[w] >= 0), key=found.get)


def caption_accuracy(model: K3Model, tokenizer: Tokenizer, cases, max_tokens: int = 24) -> dict:
    """Greedy instant-mode replies through the serving engine to each held-out image: the share whose
    reply (its response channel, `parse_output`) names the image's colour first, the share naming any
    colour, and the chance level of a reply that names one colour at random."""
    engine = Engine(model, EngineOptions(max_model_len=1024, max_num_seqs=8), tokenizer=tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_special_tokens=False,
                            spaces_between_special_tokens=False)  # as the parser reads it
    prompts = [expand_images(tokenize_messages(tokenizer, messages(image, question, image_first=first),
                                               thinking=False),
                             [ImageInput.from_image(image, model.vision.processor)], tokenizer)
               for image, _, _, question, first in cases]
    outputs = engine.generate(prompts, [params] * len(prompts))
    said = [named(parse_output(out.text, thinking=False).content or "", COLOURS) for out in outputs]
    right = [s[:1] == [colour] for s, (_, colour, *_) in zip(said, cases)]
    return {"images": len(cases), "colour": float(np.mean(right)), "names_a_colour": float(np.mean([bool(s) for s in said])),
            "chance_colour": 1 / len(COLOURS),
            "replies": sorted({parse_output(out.text, thinking=False).content or "" for out in outputs})[:8]}
