"""The cost and the effect of the engine's batch-invariant mode (`--batch-invariant`), k3-tiny bf16:

- decode tokens/s of one greedy request, and of 16 at once, with and without the mode (interleaved
  rounds, medians): alone, the mode runs every step at the largest bucket;
- how many of 16 greedy copies of one request, run together, equal the request run alone (tokens
  and logprobs), with and without the mode.

    python -m benchmarks.batch_invariant
"""

from __future__ import annotations

import time

import jax
import numpy as np

from benchmarks.report import report
from k3jax.config import K3Config
from k3jax.model import K3Model
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams

PROMPT = list(range(3, 35))  # 32 tokens
STEPS, ROUNDS, COPIES = 32, 3, 16


def generate(engine: Engine, n: int, max_tokens: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    return engine.generate([PROMPT] * n, [params] * n)


def decode_tokens_per_s(engine: Engine, n: int) -> float:
    """The decode phase: generating 1 + STEPS tokens minus generating 1."""
    start = time.perf_counter()
    generate(engine, n, 1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    generate(engine, n, 1 + STEPS)
    return n * STEPS / (time.perf_counter() - start - one)


def main() -> None:
    model = K3Model.random(K3Config.from_preset("k3-tiny"), dtype="bfloat16", seed=0)
    options = dict(max_model_len=128, max_num_seqs=COPIES, max_num_batched_tokens=256, max_prefill_chunk=32)
    engines = {mode: Engine(model, EngineOptions(**options, batch_invariant=mode)) for mode in (False, True)}
    for engine in engines.values():
        engine.warmup()
    speeds = {(mode, n): [] for mode in engines for n in (1, COPIES)}
    for r in range(ROUNDS):
        for mode in (False, True) if r % 2 == 0 else (True, False):
            for n in (1, COPIES):
                speeds[mode, n].append(decode_tokens_per_s(engines[mode], n))
    rows = []
    for mode, engine in engines.items():
        alone = generate(engine, 1, 16)[0]
        together = generate(engine, COPIES, 16)
        same = sum(o.token_ids == alone.token_ids and o.logprobs == alone.logprobs for o in together)
        rows.append({"batch_invariant": mode, "tokens_per_s_batch1": float(np.median(speeds[mode, 1])),
                     f"tokens_per_s_batch{COPIES}": float(np.median(speeds[mode, COPIES])),
                     f"copies_equal_alone_of_{COPIES}": same})
    report("batch_invariant", rows, note=f"k3-tiny bf16, prompt {len(PROMPT)}, {STEPS} decode steps, "
                                         f"{ROUNDS} interleaved rounds, medians, {jax.default_backend()}")


if __name__ == "__main__":
    main()
