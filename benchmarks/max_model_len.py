"""What a long max_model_len costs a short request (issue 25): one prefill chunk and one decode step
of the engine's paged step at 2K, 128K and 1M tokens of max_model_len, on the same context.

Every step's page table spans max_model_len (the runner's width: nothing recompiles as contexts
grow), so a step that read or expanded the whole table would cost in proportion to it; the MLA
attention visits only the blocks of pages up to each row's length. Embedded k3-tiny (fp32), one
sequence: a 512-token chunk at offset 512 and a decode step at context 1024, each through its own
`serve.runner.Runner` per width with the same small pool; the widths alternate round by round,
medians.

    python -m benchmarks.max_model_len [--rounds 7]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.report import report
from k3jax.loading import from_pretrained
from serve.cache import CacheLayout
from serve.llm import default_model_dir
from serve.runner import Runner

WIDTHS = (2048, 131072, 1048576)
PAGE, CONTEXT, CHUNK = 16, 1024, 512


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    model = from_pretrained(default_model_dir(), dtype="float32")
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, CONTEXT + 1).tolist()
    pages = list(range(1, CONTEXT // PAGE + 2))
    runners = {w: Runner(model, CacheLayout(PAGE, len(pages) + 1, 2), max_model_len=w) for w in WIDTHS}

    def chunk(runner):  # the second half of the prompt after the first
        return runner.run([(tokens[CHUNK:CONTEXT], CHUNK, 1, pages)], 1, CHUNK)[0]

    def decode(runner):
        return runner.run([(tokens[CONTEXT:], CONTEXT, 1, pages)], 1, 1)[0]

    for runner in runners.values():  # the first half, and a compile of each step
        runner.run([(tokens[:CHUNK], 0, 1, pages)], 1, CHUNK)
        np.asarray(chunk(runner)), np.asarray(decode(runner))
    times = {(w, step): [] for w in WIDTHS for step in ("chunk", "decode")}
    for r in range(args.rounds):
        for w in WIDTHS if r % 2 == 0 else WIDTHS[::-1]:
            for step, fn in (("chunk", chunk), ("decode", decode)):
                start = time.perf_counter()
                np.asarray(fn(runners[w]))
                times[w, step].append(1e3 * (time.perf_counter() - start))
    rows = []
    for w in WIDTHS:
        row = {"max_model_len": w, "table_pages": runners[w].page_table_width}
        for step in ("chunk", "decode"):
            row[f"{step}_ms"] = float(np.median(times[w, step]))
            row[f"{step}_vs_2k"] = row[f"{step}_ms"] / float(np.median(times[WIDTHS[0], step]))
        rows.append(row)
    report("max_model_len", rows, note=f"k3-tiny fp32, a {CHUNK}-token chunk at offset {CHUNK} and a decode step at "
                                       f"context {CONTEXT}, pages of {PAGE}, {args.rounds} interleaved rounds, medians")


if __name__ == "__main__":
    main()
