"""The server under load: requests/s, TTFT and inter-token latency (p50 / p99) at concurrency 1, 8 and 32,
and the server's throughput against the offline engine on the same workload (its overhead).

    python -m benchmarks.serve_load [--requests 64] [--max-tokens 32]

Runs `python -m k3jax.serve` on the embedded k3-tiny (fp32) in a subprocess and drives it with the
`openai` client's streaming completions; the offline figure runs the same prompts through the
same engine options in this process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

import numpy as np
import openai

from benchmarks.report import report
from k3jax.loading import from_pretrained
from serve.engine import Engine, EngineOptions
from serve.llm import default_model_dir
from serve.sampling import SamplingParams

CONCURRENCY = (1, 8, 32)
OPTIONS = {"max_model_len": 256, "max_num_seqs": 32, "max_num_batched_tokens": 256}
FLAGS = ["--max-model-len", "256", "--max-num-seqs", "32", "--max-num-batched-tokens", "256"]


def prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, int(rng.integers(8, 64))).tolist() for _ in range(count)]


def start_server() -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "k3jax.serve", "--port", "0", "--dtype", "float32", "--log-level", "warning",
               *FLAGS]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    for line in process.stdout:  # the server prints its URL when it is ready
        if "http://" in line:
            return process, line.split()[-1]
    raise RuntimeError("the server exited before printing its URL")


def one_stream(client, prompt, max_tokens) -> tuple[float, list[float], int]:
    """(TTFT, inter-token gaps, tokens) of one streamed completion."""
    start = time.perf_counter()
    stamps = []
    for chunk in client.completions.create(model="k3-tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                          stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text is not None:
            stamps.append(time.perf_counter())
    return stamps[0] - start, list(np.diff(stamps)), len(stamps)


def server_rows(url, workload, max_tokens) -> list[dict]:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    one_stream(client, workload[0], 2)  # warm the connection
    rows = []
    for concurrency in CONCURRENCY:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda p: one_stream(client, p, max_tokens), workload))
        elapsed = time.perf_counter() - start
        ttft = np.array([r[0] for r in results])
        gaps = np.concatenate([r[1] for r in results])
        rows.append({"concurrency": concurrency, "requests_per_s": len(workload) / elapsed,
                     "tokens_per_s": sum(r[2] for r in results) / elapsed,
                     "ttft_p50_ms": 1e3 * np.percentile(ttft, 50), "ttft_p99_ms": 1e3 * np.percentile(ttft, 99),
                     "itl_p50_ms": 1e3 * np.percentile(gaps, 50), "itl_p99_ms": 1e3 * np.percentile(gaps, 99)})
    return rows


def offline_tokens_per_s(workload, max_tokens) -> float:
    engine = Engine(from_pretrained(default_model_dir(), dtype="float32"), EngineOptions(**OPTIONS))
    engine.warmup()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for prompt in workload:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return len(workload) * max_tokens / (time.perf_counter() - start)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    workload = prompts(args.requests)
    default_model_dir()  # written once, before the server and this process both read it
    process, url = start_server()
    try:
        rows = server_rows(url, workload, args.max_tokens)
    finally:
        process.terminate()
        process.wait(timeout=60)
    offline = offline_tokens_per_s(workload, args.max_tokens)
    for row in rows:
        row["vs_offline"] = row["tokens_per_s"] / offline
    report("serve_load", rows, note=f"k3-tiny fp32, {args.requests} streamed completions of {args.max_tokens} tokens; "
                                    f"offline engine on the same prompts: {offline:.0f} tokens/s")


if __name__ == "__main__":
    main()
