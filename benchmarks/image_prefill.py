"""What an image costs a prompt's prefill, on the embedded k3-tiny with its tiny vision tower (the
shipped weights: what `make serve` encodes images with): the time to first token of a prompt holding
one image against a text prompt of the same token count, on the same engine and on an engine of the
same model without the tower (what having a tower costs a text prefill: since 4dffe62 a text prefill
carries no embeddings override; results before it measured one of zeros). The image is timed with its
encoder run (a new image each round) and with the encoder's output cached (the same image again;
prefix caching off, so the prefill is recomputed). Also the encoder alone: images/s and patches/s.
Three image sizes (SIZES), interleaved rounds, medians. Results before the embedded model had a tower
were measured on a synthetic k3-tiny (random weights, the same shapes).

    python -m benchmarks.image_prefill
"""

from __future__ import annotations

import time

import jax
import numpy as np
from PIL import Image

from benchmarks.report import report
from k3jax.model import K3Model
from serve.engine import Engine
from serve.llm import LLM
from serve.multimodal import PLACEHOLDER, ImageInput, expand_images
from serve.sampling import SamplingParams

SIZES = ((224, 224), (448, 448), (1920, 1080))  # 64, 256 and 2691 image tokens
ROUNDS = 9
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def noise(seed: int, size) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8))


def ttft_ms(engine: Engine, prompt) -> float:
    start = time.perf_counter()
    engine.generate([prompt], [FIRST_TOKEN])
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    llm = LLM(max_prefill_chunk=4096, max_num_batched_tokens=4096, max_model_len=4096)  # the embedded k3-tiny, bf16
    engine, vision, tokenizer = llm.engine, llm.model.vision, llm.engine.tokenizer
    text_model = K3Model(llm.model.config, llm.model.graphdef, llm.model.params)  # the same weights, no tower
    text_engine = Engine(text_model, engine.options, tokenizer=tokenizer)
    template = tokenizer.encode_prompt(f"Describe this image: {PLACEHOLDER}")
    rng, seeds = np.random.default_rng(0), iter(range(10 ** 6))
    rows = []
    for size in SIZES:
        cached = expand_images(template, [ImageInput.from_image(noise(next(seeds), size), vision.processor)], tokenizer)
        text = rng.integers(0, 256, len(cached.ids)).tolist()  # byte tokens: the same count, no image
        prepared = vision.prepare(noise(0, size))

        def fresh():  # a new image each time: the encoder runs
            image = ImageInput.from_image(noise(next(seeds), size), vision.processor)
            return expand_images(template, [image], tokenizer)

        runs = {"text_no_tower_ms": lambda: ttft_ms(text_engine, text), "text_ms": lambda: ttft_ms(engine, text),
                "image_cached_ms": lambda: ttft_ms(engine, cached), "image_ms": lambda: ttft_ms(engine, fresh()),
                "encoder_ms": lambda: _timed_ms(lambda: vision.encode(prepared))}
        for run in runs.values():  # compile every shape first
            run()
        times = {name: [] for name in runs}
        for r in range(ROUNDS):
            for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                times[name].append(runs[name]())
        ms = {name: float(np.median(t)) for name, t in times.items()}
        rows.append({"image": f"{size[0]}x{size[1]}", "image_tokens": cached.spans[0].image.num_tokens,
                     "prompt_tokens": len(cached.ids), **ms,
                     "images_per_s": 1e3 / ms["encoder_ms"], "patches_per_s": 1e3 * prepared.num_patches / ms["encoder_ms"],
                     "image_vs_text": ms["image_ms"] / ms["text_ms"],
                     "override_cost": ms["text_ms"] / ms["text_no_tower_ms"]})
    report("image_prefill", rows, note=f"embedded k3-tiny bf16 with its 2-layer 32-wide tower, time to first "
                                       f"token, one prefill chunk, {ROUNDS} interleaved rounds, medians, "
                                       f"{jax.default_backend()}")


def _timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


if __name__ == "__main__":
    main()
