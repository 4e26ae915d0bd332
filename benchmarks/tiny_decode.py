"""Decode throughput of k3-tiny on this machine at batch 1 and 16 (greedy, jitted step, warm).

    python -m benchmarks.tiny_decode
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import report
from k3jax.config import K3Config
from k3jax.model import K3Model

PROMPT, STEPS = 32, 64


def tokens_per_second(model: K3Model, batch: int) -> float:
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, PROMPT), dtype=np.int32)
    logits, cache = model.prefill(prompt, max_len=PROMPT + 2 * STEPS + 1)
    token = jnp.argmax(logits[:, -1], axis=-1)
    for _ in range(3):  # warm-up (compile) steps
        logits, cache = model.decode(token, cache)
        token = jnp.argmax(logits, axis=-1)
    jax.block_until_ready(token)
    start = time.perf_counter()
    for _ in range(STEPS):
        logits, cache = model.decode(token, cache)
        token = jnp.argmax(logits, axis=-1)
    jax.block_until_ready(token)
    return batch * STEPS / (time.perf_counter() - start)


def main() -> None:
    rows = []
    for dtype in ("float32", "bfloat16"):
        model = K3Model.random(K3Config.from_preset("k3-tiny"), dtype=dtype)
        for batch in (1, 16):
            rows.append({"dtype": dtype, "batch": batch, "tokens_per_s": tokens_per_second(model, batch)})
    report("tiny_decode", rows, note=f"k3-tiny, prompt {PROMPT}, {STEPS} greedy steps, {jax.default_backend()}")


if __name__ == "__main__":
    main()
