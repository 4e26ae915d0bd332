"""The vision stage: trains k3-tiny's vision tower and projector (K3_TINY_VISION) to caption images,
tuning the text model lightly beside it.

The data are synthetic: one shape (SHAPES) of one colour (COLOURS) at a random place and size on a
grey background of a random level, drawn with Pillow at a random size of SIZES_PX (4 to 16 image
tokens). Each image becomes a chat turn in K3's format, rendered and expanded by the serving code
itself (`serve.chat.encoding`, `serve.multimodal.expand_images`): the user sends the image and asks
what it shows (image or question first), the assistant answers "A red circle." (in thinking mode
after the reasoning "The image shows a red circle."). The loss is the replies' next-token
cross-entropy, the caption's words weighted CAPTION_WEIGHT; the tower's outputs replace the
`<|media_pad|>` embeddings.

Why the text model is tuned, not frozen: the text stage's k3-tiny is small and undertrained, and a
few image embeddings alone do not steer it (frozen, the caption loss stays flat over 30 steps at
learning rates from 3e-3 to 0.1). It starts from the checkpoint as served (bf16, MXFP4 experts
decoded: `target.pretrained`), learns at a quarter of the text stage's peak rate, and every step's
loss adds `text_rows` rows of the text stage's corpus so that it keeps what it knew;
`python -m k3jax.train` measures the text figures again after this stage.
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
from k3jax.train.target import TrainOptions, next_token_loss, optimizer
from k3jax.vision.config import ImageProcessorConfig, VisionConfig
from k3jax.vision.tower import PatchLayout, VisionTower, patch_layout
from serve.chat.encoding import tokenize_messages
from serve.chat.parsing import parse_output
from serve.chat.tokenizer import Tokenizer
from serve.engine import Engine, EngineOptions
from serve.multimodal import ImageInput, expand_images
from serve.sampling import SamplingParams

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (240, 210, 20),
           "purple": (140, 40, 180)}
SHAPES = ("circle", "square", "triangle", "cross")
SIZES_PX = (56, 84, 112)  # each side: 2 to 4 merged 28-px tokens
QUESTIONS = ("What does this image show?", "What is in this picture?", "Describe the image.", "What do you see?")
MAX_PATCHES = (max(SIZES_PX) // 14) ** 2  # every image's patches padded to this: one compiled tower
ROWS = {False: 192, True: 512}  # tokens a row predicts, instant and thinking mode (longest seen + margin)
# the loss weight of the caption's words (the rest of a reply: 1): they are what the image decides, and
# at weight 1 the reply's fixed markup, learnt in a few steps, dilutes them
CAPTION_WEIGHT = 4.0
HELD_OUT_SEED = 1 << 20  # the held-out images' stream, apart from every training seed


@dataclasses.dataclass(frozen=True)
class VisionOptions:
    steps: int = 56
    batch: int = 8
    thinking_every: int = 4  # every fourth step's batch is in thinking mode (its rows are ~3x as long)
    text_rows: int = 2  # corpus rows per step: the text stage's data, so the text model keeps what it knew
    text_length: int = 512
    tower_lr: float = 3e-2  # a fresh tower, a few steps
    text_lr: float = 1e-3  # a quarter of the text stage's peak
    warmup: int = 5
    weight_decay: float = 0.01
    seed: int = 0
    held_out: int = 40


def draw(rng: np.random.Generator) -> tuple[Image.Image, str, str]:
    """(image, colour, shape): one shape on a plain grey background, all of it drawn from `rng`."""
    width, height = (int(rng.choice(SIZES_PX)) for _ in range(2))
    colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
    image = Image.new("RGB", (width, height), (int(rng.integers(0, 256)),) * 3)
    canvas = ImageDraw.Draw(image)
    r = rng.uniform(0.25, 0.45) * min(width, height)  # half the shape's extent
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


def messages(image: Image.Image, question: str, caption: str | None = None, image_first: bool = True) -> list[dict]:
    """The user's turn (the image and the question, in either order) and, with a caption, the
    assistant's reply."""
    parts = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": question}]
    out = [{"role": "user", "content": parts if image_first else parts[::-1]}]
    if caption is not None:
        out.append({"role": "assistant", "reasoning_content": f"The image shows a {caption}.",
                    "content": f"A {caption}."})
    return out


@dataclasses.dataclass(frozen=True)
class Example:
    ids: np.ndarray  # int32: the whole conversation, the image's pads expanded
    reply_start: int  # where the assistant's generated tokens begin (the prompt's length)
    pad_start: int  # the first <|media_pad|> position
    image: ImageInput
    caption: tuple[int, int]  # [start, stop) of the caption's words in the reply's response channel


def example(tokenizer: Tokenizer, processor: ImageProcessorConfig, image: Image.Image, question: str,
            caption: str, thinking: bool, image_first: bool = True) -> Example:
    prepared = ImageInput.from_image(image, processor)
    convo = messages(image, question, caption, image_first)
    whole = expand_images(tokenize_messages(tokenizer, convo, thinking=thinking, add_generation_prompt=False),
                          [prepared], tokenizer)
    prompt = expand_images(tokenize_messages(tokenizer, convo[:1], thinking=thinking), [prepared], tokenizer)
    words = tokenizer.encode(f" {caption}.")  # as the reply's "A red circle." holds them (byte tokens)
    ids = np.asarray(whole.ids, np.int32)
    stop = max(i for i in range(len(prompt.ids), len(ids)) if ids[i - len(words):i].tolist() == words)
    return Example(ids, len(prompt.ids), whole.spans[0].start, prepared, (stop - len(words) + 1, stop - 1))


def batch(cfg: VisionConfig, examples: list[Example], length: int):
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
    """The replies' mean next-token cross-entropy with the tower's outputs at the pads."""
    embeds = image_embeddings(tower_graphdef, tower_params, pixels, layouts, starts, counts, tokens.shape[1] - 1)
    with training_moe():  # the experts' differentiable path
        logits = nnx.merge(text_graphdef, text_params).forward(tokens[:, :-1], embeds=embeds).logits
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    return jnp.sum(weights * nll) / jnp.sum(weights)


class Stream:
    """Training batches drawn from a seeded stream: images, questions, and the mode of each step."""

    def __init__(self, tokenizer: Tokenizer, cfg: VisionConfig, processor: ImageProcessorConfig, seed: int):
        self.tokenizer, self.cfg, self.processor = tokenizer, cfg, processor
        self.rng = np.random.default_rng(seed)

    def __call__(self, size: int, thinking: bool):
        examples = []
        for _ in range(size):
            image, colour, shape = draw(self.rng)
            question, image_first = str(self.rng.choice(QUESTIONS)), bool(self.rng.integers(2))
            examples.append(example(self.tokenizer, self.processor, image, question, f"{colour} {shape}", thinking,
                                    image_first))
        return batch(self.cfg, examples, ROWS[thinking])


def train(text_graphdef, text_params, cfg: VisionConfig, images, corpus_rows, options: VisionOptions, log=print):
    """Trains a fresh fp32 tower (seeded by options.seed) and tunes the text model (of a
    `training_config`, `target.pretrained`) on `images(batch, thinking)` and `corpus_rows(rows)` together. Returns (tower graphdef, tower
    params, text params, per-step losses: captions and corpus)."""
    tower_graphdef, tower = nnx.split(VisionTower(cfg, dtype=jnp.float32, rngs=nnx.Rngs(options.seed)))
    warmup = min(options.warmup, options.steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, options.tower_lr, warmup, options.steps, options.tower_lr / 10)
    tower_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=options.weight_decay))
    text_tx = optimizer(TrainOptions(steps=options.steps, lr=options.text_lr, warmup=options.warmup,
                                     weight_decay=options.weight_decay), text_params)

    def loss(trainable, vision_arrays, corpus_arrays):
        captions = caption_loss(*trainable, tower_graphdef, text_graphdef, *vision_arrays)
        corpus, _ = next_token_loss(text_graphdef, trainable[1], *corpus_arrays)
        return captions + corpus, (captions, corpus)

    @jax.jit
    def step(trainable, states, vision_arrays, corpus_arrays):
        (_, parts), grads = jax.value_and_grad(loss, has_aux=True)(trainable, vision_arrays, corpus_arrays)
        out = [tx.update(g, s, p) for tx, g, s, p in zip((tower_tx, text_tx), grads, states, trainable)]
        trainable = tuple(optax.apply_updates(p, u) for p, (u, _) in zip(trainable, out))
        return trainable, tuple(s for _, s in out), parts

    trainable = (tower, text_params)
    states = (tower_tx.init(tower), text_tx.init(text_params))
    history = {"caption_loss": [], "corpus_loss": []}
    for i in range(options.steps):
        thinking = i % options.thinking_every == options.thinking_every - 1
        size = options.batch // 2 if thinking else options.batch  # rows ~3x as long: a step of like cost
        trainable, states, (captions, corpus) = step(trainable, states, images(size, thinking),
                                                     corpus_rows(options.text_rows))
        history["caption_loss"].append(round(float(captions), 4))
        history["corpus_loss"].append(round(float(corpus), 4))
        if log and (i % 10 == 0 or i == options.steps - 1):
            log(f"vision step {i}: caption loss {captions:.3f}, corpus loss {corpus:.3f}")
    return tower_graphdef, trainable[0], trainable[1], history


def tower_arrays(params) -> dict[tuple, np.ndarray]:
    """The tower's parameters by path, as `convert.export.vision_checkpoint_tensors` takes them."""
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)}


def held_out(count: int, seed: int) -> list[tuple[Image.Image, str, str, str, bool]]:
    """(image, colour, shape, question, image first, thinking) of images drawn apart from every
    training stream; half of them asked in thinking mode."""
    rng = np.random.default_rng(HELD_OUT_SEED + seed)
    return [(*draw(rng), str(rng.choice(QUESTIONS)), bool(rng.integers(2)), bool(i % 2)) for i in range(count)]


def named(content: str, words) -> list[str]:
    """The words of `words` that `content` names, in the order they appear."""
    found = {w: content.lower().find(w) for w in words}
    return sorted((w for w in words if found[w] >= 0), key=found.get)


def caption_accuracy(model: K3Model, tokenizer: Tokenizer, cases, max_tokens: int = 48) -> dict:
    """Greedy replies through the serving engine to each held-out image: the share whose reply
    (its response channel, `parse_output`) names the image's colour first, its shape first, and both,
    with the chance levels of a reply that names one colour and one shape at random."""
    engine = Engine(model, EngineOptions(max_model_len=1024, max_num_seqs=8), tokenizer=tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_special_tokens=False,
                            spaces_between_special_tokens=False)  # as the parser reads it
    prompts = [expand_images(tokenize_messages(tokenizer, messages(image, question, image_first=first),
                                               thinking=thinking),
                             [ImageInput.from_image(image, model.vision.processor)], tokenizer)
               for image, _, _, question, first, thinking in cases]
    outputs = engine.generate(prompts, [params] * len(prompts))
    colour_ok, shape_ok = [], []
    for out, (_, colour, shape, _, _, thinking) in zip(outputs, cases):
        content = parse_output(out.text, thinking=thinking).content or ""
        colour_ok.append(named(content, COLOURS)[:1] == [colour])
        shape_ok.append(named(content, SHAPES)[:1] == [shape])
    colour_ok, shape_ok = np.asarray(colour_ok), np.asarray(shape_ok)
    return {"images": len(cases), "colour": float(colour_ok.mean()), "shape": float(shape_ok.mean()),
            "both": float((colour_ok & shape_ok).mean()), "chance_colour": 1 / len(COLOURS),
            "chance_shape": 1 / len(SHAPES), "chance_both": 1 / (len(COLOURS) * len(SHAPES))}
