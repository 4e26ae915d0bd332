"""Log-likelihood throughput of the eval job (`k3jax.eval`) on k3-tiny at batch 1, 8 and 32, with and
without length-sorted batching, and the padding each leaves.

    python -m benchmarks.eval_loglikelihood

Requests are 40..64 tokens (two length buckets, so each batch size compiles two programs); every
figure is the best of three warm runs of the whole job (parse, plan, forward, write, final sort),
sorted and unsorted interleaved.
"""

from __future__ import annotations

import json
import os
import tempfile

import jax
import numpy as np

from benchmarks.report import report
from k3jax.config import K3Config
from k3jax.eval import EvalOptions, evaluate
from k3jax.model import K3Model

REQUESTS, MAX_LENGTH = 256, 64


def write_requests(path: str, vocab: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(REQUESTS):
            n = int(rng.integers(40, MAX_LENGTH + 1))
            k = int(rng.integers(1, 9))  # continuation tokens
            ids = rng.integers(0, vocab, n).tolist()
            f.write(json.dumps({"id": i, "context_ids": ids[:-k], "continuation_ids": ids[-k:]}) + "\n")


def run(model, data: str, directory: str, batch: int, repeats: int = 3) -> dict[bool, dict]:
    """Sorted and unsorted jobs, interleaved so that a noisy neighbour slows both alike; the fastest
    of `repeats` warm runs of each (the first run of each compiles)."""
    best: dict[bool, dict] = {}
    for attempt in range(repeats + 1):
        for sort in (True, False):
            options = EvalOptions(batch_size=batch, max_length=MAX_LENGTH, sort=sort, progress=False)
            summary = evaluate(model, None, data, os.path.join(directory, f"{attempt}-{batch}-{sort}.jsonl"), options)
            if attempt and summary["examples_per_s"] > best.get(sort, {"examples_per_s": -1})["examples_per_s"]:
                best[sort] = summary
    return best


def main() -> None:
    model = K3Model.random(K3Config.from_preset("k3-tiny"), dtype="bfloat16", mesh="1x1")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        data = os.path.join(directory, "requests.jsonl")
        write_requests(data, model.config.vocab_size)
        for batch in (1, 8, 32):
            runs = run(model, data, directory, batch)
            rows.append({"batch": batch, "examples_per_s": runs[True]["examples_per_s"],
                         "unsorted_examples_per_s": runs[False]["examples_per_s"],
                         "padding_waste": runs[True]["padding_waste"],
                         "unsorted_padding_waste": runs[False]["padding_waste"],
                         "compiled_shapes": runs[True]["compiled_shapes"]})
    report("eval_loglikelihood", rows, note=f"k3-tiny bf16, {REQUESTS} requests of 40..{MAX_LENGTH} tokens, "
                                           f"{jax.default_backend()}, mesh 1x1, warm")


if __name__ == "__main__":
    main()
