"""The cost of structured outputs per generated token (serve/structured.py), on the embedded k3-tiny:
decode tokens/s of greedy requests whose output a grammar constrains (a regex that lasts the whole
run, so every step masks) against the same requests free, at batch 1 and 16, interleaved rounds,
medians. A constrained request does not run ahead (its next mask needs the token in flight), so the
free requests are also timed without async scheduling: that column separates the grammar's own
work (its masks on the host, the bitmask in the sampler) from the overlap it gives up.

    python -m benchmarks.structured_overhead
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from benchmarks.report import report
from serve.engine import Engine
from serve.llm import LLM
from serve.sampling import SamplingParams
from serve.structured import StructuredOutputsParams

PROMPT = list(range(3, 35))  # 32 tokens
STEPS, ROUNDS, BATCHES = 32, 3, (1, 16)
CONSTRAINT = StructuredOutputsParams(regex="[a-z]{200}")  # longer than any run: every step masks


def decode_tokens_per_s(engine: Engine, n: int, constrained: bool) -> float:
    """The decode phase: generating 1 + STEPS tokens minus generating 1."""
    seconds = []
    for max_tokens in (1, 1 + STEPS):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                structured_outputs=CONSTRAINT if constrained else None)
        start = time.perf_counter()
        outputs = engine.generate([PROMPT] * n, [params] * n)
        seconds.append(time.perf_counter() - start)
        assert all(len(o.token_ids) == max_tokens for o in outputs)
    return n * STEPS / (seconds[1] - seconds[0])


def main() -> None:
    llm = LLM(max_num_seqs=max(BATCHES), max_num_batched_tokens=512, max_model_len=128)
    sync = Engine(llm.model, dataclasses.replace(llm.engine.options, async_scheduling=False),
                  tokenizer=llm.engine.tokenizer)
    runs = {"free": (llm.engine, False), "free_no_async": (sync, False), "constrained": (llm.engine, True)}
    speeds = {(name, n): [] for name in runs for n in BATCHES}
    for n in BATCHES:  # compile every shape first
        for engine, constrained in runs.values():
            decode_tokens_per_s(engine, n, constrained)
    for r in range(ROUNDS):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            for n in BATCHES:
                speeds[name, n].append(decode_tokens_per_s(*runs[name][:1], n, runs[name][1]))
    rows = []
    for n in BATCHES:
        tps = {name: float(np.median(speeds[name, n])) for name in runs}
        step_ms = {name: 1e3 * n / v for name, v in tps.items()}  # one decode step of the batch
        rows.append({"batch": n, **{f"{name}_tok_s": v for name, v in tps.items()},
                     "overhead_ms_per_step": step_ms["constrained"] - step_ms["free"],
                     "overhead_ms_per_step_vs_no_async": step_ms["constrained"] - step_ms["free_no_async"],
                     "constrained_vs_free": tps["constrained"] / tps["free"]})
    report("structured_overhead", rows, note=f"k3-tiny bf16, 512-token vocabulary, regex over the whole output, "
                                             f"{STEPS} decode steps, {ROUNDS} interleaved rounds, medians, "
                                             f"{jax.default_backend()}")


if __name__ == "__main__":
    main()
