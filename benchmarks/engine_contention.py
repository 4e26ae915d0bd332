"""Would the engine gain from a process of its own? The offline engine's tokens/s in serve_load's
closed loop alone, and with a Python load beside it taking the CPU share that serving adds: in a thread
of the engine's process (the server today: the HTTP thread shares the engine's process and its GIL), in
another process (vLLM's layout, the API server apart from the engine core), and in another process at
the lowest priority (nice 19).

    python -m benchmarks.engine_contention [--duty 0.2] [--repeats 7]

serve_load splits the server's CPU by thread: XLA:CPU's compute threads spend what the offline engine's
do, and the Python threads spend about 0.3 CPU-seconds more per run of 64 requests, about a fifth of a
core over the run (the HTTP work: parsing, JSON, server-sent events, socket writes). The load here is
that: a Python loop holding the GIL for `--duty` of every 0.8 ms, sleeping the rest. If the load slows
the engine as much from another process as from a thread, what serving costs on this machine is CPU
time, not the GIL, and splitting the engine into its own process would not recover it. The four
settings alternate, `--repeats` times at each concurrency; the table has each one's median tokens/s
over the alone runs' median.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import threading
import time

import numpy as np

from benchmarks.report import report
from benchmarks.serve_load import CONCURRENCY, OPTIONS, offline_at, prompts, summary
from k3jax.loading import from_pretrained
from k3jax.serve import enable_compilation_cache
from serve.engine import Engine, EngineOptions
from serve.llm import default_model_dir, load_tokenizer

PERIOD_S = 0.0008
MAX_TOKENS = 32  # serve_load's default
SETTINGS = ("alone", "thread", "process", "process_nice")


def load(ready, stop, duty: float, nice: int) -> None:
    """Python work holding the GIL for duty x PERIOD_S, then asleep for the rest, until `stop` is set."""
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    ready.set()
    values: dict[int, str] = {}
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < duty * PERIOD_S:
            values[len(values) % 7] = str(start)
        time.sleep(PERIOD_S * (1 - duty))


def tokens_per_s(engine: Engine, workload, concurrency: int, setting: str, duty: float) -> float:
    if setting == "alone":
        return summary(*offline_at(engine, workload, concurrency, MAX_TOKENS))["tokens_per_s"]
    if setting == "thread":
        ready, stop = threading.Event(), threading.Event()
        beside = threading.Thread(target=load, args=(ready, stop, duty, 0))
    else:  # forked: the child runs only `load`, none of the parent's XLA threads' code
        fork = multiprocessing.get_context("fork")
        ready, stop = fork.Event(), fork.Event()
        beside = fork.Process(target=load, args=(ready, stop, duty, 19 if setting == "process_nice" else 0))
    beside.start()
    ready.wait()
    try:
        return summary(*offline_at(engine, workload, concurrency, MAX_TOKENS))["tokens_per_s"]
    finally:
        stop.set()
        beside.join()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duty", type=float, default=0.2, help="the load's share of one core")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    enable_compilation_cache()
    path = default_model_dir()
    engine = Engine(from_pretrained(path, dtype="float32"), EngineOptions(**OPTIONS), tokenizer=load_tokenizer(path))
    engine.warmup()
    workload = prompts(64)
    rows = []
    for concurrency in CONCURRENCY:
        runs = {setting: [] for setting in SETTINGS}
        for _ in range(args.repeats):
            for setting in SETTINGS:
                runs[setting].append(tokens_per_s(engine, workload, concurrency, setting, args.duty))
        alone = float(np.median(runs["alone"]))
        rows.append({"concurrency": concurrency, "alone_tokens_per_s": alone,
                     **{f"{setting}_vs_alone": float(np.median(runs[setting])) / alone for setting in SETTINGS[1:]}})
    report("engine_contention", rows, note=f"k3-tiny fp32, serve_load's closed loop (64 requests of {MAX_TOKENS} tokens), "
                                           f"a Python load of {args.duty:.0%} of a core beside the engine, "
                                           f"medians of {args.repeats} interleaved runs")


if __name__ == "__main__":
    main()
