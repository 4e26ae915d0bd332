"""Engine figures on k3-tiny (fp32): decode throughput against batch size, time to first token with a
cached 2048-token prefix against a cold prompt, and the host's share of a batch-64 decode step.

    python -m benchmarks.engine_throughput
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

BATCHES = (1, 4, 16, 64)
DECODE_STEPS = 32


def decode_rows(model) -> list[dict]:
    engine = Engine(model, EngineOptions(max_model_len=128, max_num_seqs=64, max_num_batched_tokens=1024,
                                         max_prefill_chunk=16, max_prefill_rows=64, block_size=16))
    engine.warmup()
    rng = np.random.default_rng(0)
    rows = []
    for batch in BATCHES:
        params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 8, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(rng.integers(0, 512, 16).tolist(), params)
        while any(r.pending > 1 or not r.output for r in engine.requests.values()):  # prefill, first token
            engine.step()
        step_s, device_s = [], []
        run = engine.runner.run

        def timed_run(*args, **kwargs):
            start = time.perf_counter()
            logits = jax.block_until_ready(run(*args, **kwargs))
            device_s.append(time.perf_counter() - start)
            return logits

        engine.runner.run = timed_run
        for _ in range(DECODE_STEPS):
            start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
        engine.runner.run = run
        while engine.has_unfinished():
            engine.step()
        step, device = float(np.median(step_s)), float(np.median(device_s))
        rows.append({"batch": batch, "step_ms": 1e3 * step, "tokens_per_s": batch / step,
                     "host_share": (step - device) / step})
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_batch_1"] = row["tokens_per_s"] / base
    return rows


def ttft_rows(model) -> list[dict]:
    engine = Engine(model, EngineOptions(max_model_len=2304, max_num_seqs=2, max_num_batched_tokens=512,
                                         max_prefill_chunk=512, max_prefill_rows=1, block_size=16,
                                         enable_prefix_caching=True))
    engine.warmup()
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 512, 2048).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ttft(prompt) -> float:
        start = time.perf_counter()
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    cold = [ttft(prefix + rng.integers(0, 512, 16).tolist()) for _ in range(1)]
    engine.reset_prefix_cache()
    ttft(prefix + [1] * 16)  # leaves the 2048-token prefix cached
    warm = [ttft(prefix + rng.integers(0, 512, 16).tolist()) for _ in range(3)]
    cold += [ttft(rng.integers(0, 512, 2064).tolist()) for _ in range(2)]
    cold_s, warm_s = float(np.median(cold)), float(np.median(warm))
    return [{"prompt_tokens": 2064, "cached_tokens": 2048, "cold_ttft_ms": 1e3 * cold_s,
             "cached_ttft_ms": 1e3 * warm_s, "speedup": cold_s / warm_s,
             "hit_rate": engine.prefix_cache.hit_rate}]


def main() -> None:
    model = K3Model.random(K3Config.from_preset("k3-tiny"), dtype="float32", seed=0)
    report("engine_decode_throughput", decode_rows(model),
           note="k3-tiny fp32, greedy, median of 32 decode steps; host_share = (step - model call) / step")
    report("engine_ttft_prefix_cache", ttft_rows(model), note="k3-tiny fp32, 2064-token prompts, median")


if __name__ == "__main__":
    main()
