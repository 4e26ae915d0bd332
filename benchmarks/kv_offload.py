"""KV offload (`kv_offload_bytes`, serve/kv_offload.py): the time to first token of a long-prefix
request whose prefix the prefix cache evicted, restored from the host tier against recomputed.
Synthetic k3-tiny (random weights), bf16, prefix caching on in both arms.

A round, per prompt length and arm: the prefix cache starts empty, the prompt runs once (its pages
and the KDA snapshot at its last full page are cached), another prompt of the same length evicts
them (the pool holds about one max_model_len request), then the prompt runs again, timed. With the
tier the second run brings its pages and snapshot back from host memory and computes the tail past
the last page boundary; without it, it prefills everything again. Both arms run the same engine
options but the budget (the same compiled steps); the order flips every round; medians over rounds.

    python -m benchmarks.kv_offload [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from benchmarks.report import report
from k3jax.config import K3Config
from k3jax.model import K3Model
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams

MAX_LEN, PAGE = 16384, 16
LENGTHS = (2048, 8000, 16000)
PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """(time to first token in ms, prompt tokens computed) of one request run alone."""
    computed = engine.stats()["num_computed_prompt_tokens"]
    start = time.perf_counter()
    engine.generate([prompt], [PARAMS])
    return 1e3 * (time.perf_counter() - start), engine.stats()["num_computed_prompt_tokens"] - computed


def evicted_then_again(engine: Engine, length: int, seed: int) -> tuple[float, int]:
    engine.reset_prefix_cache()
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 512, length).tolist()
    engine.generate([prompt], [PARAMS])
    engine.generate([rng.integers(0, 512, MAX_LEN - 1).tolist()], [PARAMS])  # evicts the prompt's pages
    return ttft(engine, prompt)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    model = K3Model.random(K3Config.from_preset("k3-tiny"), dtype="bfloat16", seed=0)
    options = dict(max_model_len=MAX_LEN, max_num_seqs=2, max_num_batched_tokens=1024, max_prefill_chunk=1024,
                   block_size=PAGE, num_gpu_blocks=MAX_LEN // PAGE + 8, enable_prefix_caching=True)
    arms = {"restored": Engine(model, EngineOptions(**options, kv_offload_bytes=256 << 20)),
            "recomputed": Engine(model, EngineOptions(**options))}
    for engine in arms.values():  # compiles every shape both arms reach (the tier's gather and scatter too)
        for length in LENGTHS:
            evicted_then_again(engine, length, 0)
    times = {(arm, length): [] for arm in arms for length in LENGTHS}
    computed = {}
    for r in range(args.rounds):
        for arm in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            for length in LENGTHS:
                ms, computed[arm, length] = evicted_then_again(arms[arm], length, 1 + r)
                times[arm, length].append(ms)
    rows = []
    for length in LENGTHS:
        row = {"prompt_tokens": length}
        for arm in arms:
            row[f"{arm}_computed_tokens"] = computed[arm, length]
            row[f"{arm}_ttft_ms"] = float(np.median(times[arm, length]))
        row["speedup"] = row["recomputed_ttft_ms"] / row["restored_ttft_ms"]
        rows.append(row)
    report("kv_offload", rows, note=f"synthetic k3-tiny bf16, pages of {PAGE} tokens, {options['num_gpu_blocks']} "
                                    f"pages, prefill chunks of 1024, {args.rounds} interleaved rounds, medians, "
                                    f"{jax.default_backend()}")


if __name__ == "__main__":
    main()
