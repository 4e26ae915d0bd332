"""The server under load against the offline engine on the same workload, at concurrency 1, 8 and 32:
requests/s, tokens/s, TTFT, inter-token latency, and the server's throughput over the engine's (1 minus
it is the server's overhead; the issue allows 15%).

    python -m benchmarks.serve_load [--requests 64] [--max-tokens 32] [--repeats 3]

Runs `python -m k3jax.serve` on the embedded k3-tiny (fp32) in a subprocess, waits until it has compiled
every step shape (it opens its port before), and drives it with streaming completions, `concurrency`
requests in flight (a closed loop). The client is the standard library's http.client, as vLLM's
serving benchmark uses a bare HTTP client: on a small machine the client's CPU competes with the
server's, and the openai client spends about four times as much per chunk. The offline
figures run the same prompts through an `Engine` with the same options and tokenizer in this process, in
the same closed loop. Server and offline runs alternate, `--repeats` times at each concurrency, and the
table has medians, so a noisy neighbour slows both alike; vs_offline is the median of the pairs' tokens/s
ratios. cpu_vs_offline compares CPU time instead (the server process's, all threads, against this
process's during the offline run), which a busy machine disturbs less; the client's CPU is in neither.
xla_cpu_ratio and python_cpu_ratio split it by thread, server over offline: XLA:CPU's compute threads
(the step's work, the same on both sides when nothing else changes) and the Python threads (the engine's
host work, plus the server's HTTP work). benchmarks/engine_contention.py asks whether moving the
latter to another process would help.

Both sides time the same events: a request's tokens arrive as text, and the byte-level tokenizer turns a
token into text only once its UTF-8 character is complete, so one streamed chunk may carry several
tokens. TTFT is the first text, ITL the gaps between text arrivals (chunks), TPOT the time per output
token after the first text, (finish - first text) / (tokens - 1).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse

import numpy as np

from benchmarks.report import report
from k3jax.loading import from_pretrained
from k3jax.serve import enable_compilation_cache
from serve.engine import Engine, EngineOptions
from serve.llm import default_model_dir, load_tokenizer
from serve.sampling import SamplingParams

CONCURRENCY = (1, 8, 32)
OPTIONS = {"max_model_len": 256, "max_num_seqs": 32, "max_num_batched_tokens": 256}
FLAGS = ["--max-model-len", "256", "--max-num-seqs", "32", "--max-num-batched-tokens", "256"]


@dataclasses.dataclass
class Timing:
    """One request: when it was sent, when new text arrived, when it finished, and its output tokens."""

    start: float
    text_times: list[float] = dataclasses.field(default_factory=list)
    finish: float = 0.0
    tokens: int = 0


def prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, int(rng.integers(8, 64))).tolist() for _ in range(count)]


def start_server() -> tuple[subprocess.Popen, str, threading.Event]:
    """The server, its URL, and an event set once it has compiled every step shape: it opens its port
    after the first request's shapes and compiles the rest behind it, which must not be measured."""
    command = [sys.executable, "-m", "k3jax.serve", "--port", "0", "--dtype", "float32", "--log-level", "info",
               "--disable-uvicorn-access-log", *FLAGS]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    compiled = threading.Event()

    def read_log():  # drained to the end, so the server never blocks on a full pipe
        for line in process.stderr:
            if (done := re.search(r"compiled (\d+) of (\d+) step shapes", line)) and done[1] == done[2]:
                compiled.set()
            elif " WARNING " in line or " ERROR " in line:
                print(line, end="", file=sys.stderr)

    threading.Thread(target=read_log, daemon=True).start()
    for line in process.stdout:  # the server prints its URL when its port is open
        if "http://" in line:
            return process, line.split()[-1], compiled
    raise RuntimeError("the server exited before printing its URL")


def stream_one(url: str, prompt: list[int], max_tokens: int) -> Timing:
    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=600)
    body = json.dumps({"model": "k3-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    timing = Timing(time.perf_counter())
    connection.request("POST", f"{address.path}/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {response.read()[:500]!r}")
    for line in response:  # server-sent events: `data: {...}` lines, then `data: [DONE]`
        if not line.startswith(b"data: {"):
            continue
        now = time.perf_counter()
        chunk = json.loads(line[len(b"data: "):])
        if chunk.get("usage"):
            timing.tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            if choice["text"]:
                timing.text_times.append(now)
            if choice["finish_reason"] is not None:
                timing.finish = now
    connection.close()
    return timing


def serve_at(url: str, workload, concurrency: int, max_tokens: int) -> tuple[list[Timing], float]:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        timings = list(pool.map(lambda p: stream_one(url, p, max_tokens), workload))
    return timings, time.perf_counter() - start


def offline_at(engine: Engine, workload, concurrency: int, max_tokens: int) -> tuple[list[Timing], float]:
    """The same closed loop on the engine: a finished request's place goes to the next prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    waiting, running, timings = list(reversed(workload)), {}, []
    chars: dict[str, int] = {}  # text length seen per request
    start = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < concurrency:
            running[engine.add_request(waiting.pop(), params)] = Timing(time.perf_counter())
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            timing = running[output.request_id]
            if len(output.text) > chars.get(output.request_id, 0):
                chars[output.request_id] = len(output.text)
                timing.text_times.append(now)
            if output.finished:
                timing.finish, timing.tokens = now, len(output.token_ids)
                timings.append(running.pop(output.request_id))
    return timings, time.perf_counter() - start


def summary(timings: list[Timing], elapsed: float) -> dict:
    ttft = [t.text_times[0] - t.start for t in timings]
    gaps = np.concatenate([np.diff(t.text_times) for t in timings])
    tpot = [(t.finish - t.text_times[0]) / (t.tokens - 1) for t in timings]
    tokens = sum(t.tokens for t in timings)
    return {"requests_per_s": len(timings) / elapsed, "tokens_per_s": tokens / elapsed,
            "ttft_p50_ms": 1e3 * np.percentile(ttft, 50), "ttft_p99_ms": 1e3 * np.percentile(ttft, 99),
            "itl_p50_ms": 1e3 * np.percentile(gaps, 50), "itl_p99_ms": 1e3 * np.percentile(gaps, 99),
            "tpot_p50_ms": 1e3 * np.percentile(tpot, 50),
            "tokens_per_chunk": tokens / sum(len(t.text_times) for t in timings)}


def cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU time of a process's threads (Linux), summed as "xla" (XLA:CPU's pools, whose
    threads are named tf_XLA...) and "python" (the rest)."""
    seconds = {"xla": 0.0, "python": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                kind = "xla" if f.read().startswith("tf_XLA") else "python"
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile (ENOENT or ESRCH)
            continue
        seconds[kind] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def measure_pair(url: str, server_pid: int, engine: Engine, workload, concurrency: int, max_tokens: int):
    """(server summary, offline summary), each with the CPU seconds its side's threads spent."""
    def timed(pid, run) -> dict:
        start = cpu_seconds(pid)
        result = summary(*run())
        end = cpu_seconds(pid)
        return {**result, **{f"{kind}_cpu_s": end[kind] - start[kind] for kind in end}}

    served = timed(server_pid, lambda: serve_at(url, workload, concurrency, max_tokens))
    offline = timed(os.getpid(), lambda: offline_at(engine, workload, concurrency, max_tokens))
    return served, offline


def row(concurrency: int, pairs: list[tuple[dict, dict]]) -> dict:
    def median(values) -> float:
        return float(np.median(list(values)))

    def cpu(side: dict) -> float:
        return side["xla_cpu_s"] + side["python_cpu_s"]

    served = {key: median(s[key] for s, _ in pairs) for key in pairs[0][0]}
    offline = {key: median(o[key] for _, o in pairs) for key in pairs[0][1]}
    return {"concurrency": concurrency, "requests_per_s": served["requests_per_s"],
            "tokens_per_s": served["tokens_per_s"], "offline_tokens_per_s": offline["tokens_per_s"],
            "vs_offline": median(s["tokens_per_s"] / o["tokens_per_s"] for s, o in pairs),
            "cpu_vs_offline": median(cpu(o) / cpu(s) for s, o in pairs),
            "xla_cpu_ratio": median(s["xla_cpu_s"] / o["xla_cpu_s"] for s, o in pairs),
            "python_cpu_ratio": median(s["python_cpu_s"] / o["python_cpu_s"] for s, o in pairs),
            "ttft_p50_ms": served["ttft_p50_ms"], "ttft_p99_ms": served["ttft_p99_ms"],
            "offline_ttft_p50_ms": offline["ttft_p50_ms"], "itl_p50_ms": served["itl_p50_ms"],
            "itl_p99_ms": served["itl_p99_ms"], "tpot_p50_ms": served["tpot_p50_ms"],
            "offline_tpot_p50_ms": offline["tpot_p50_ms"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="server and offline runs per concurrency")
    args = parser.parse_args(argv)
    workload = prompts(args.requests)
    path = default_model_dir()  # written once, before the server and this process both read it
    process, url, compiled = start_server()
    try:
        enable_compilation_cache()  # the server's: the offline warm-up loads its compiled steps
        engine = Engine(from_pretrained(path, dtype="float32"), EngineOptions(**OPTIONS),
                        tokenizer=load_tokenizer(path))
        engine.warmup()
        if not compiled.wait(timeout=900):
            raise RuntimeError("the server did not finish compiling its step shapes in 15 minutes")
        stream_one(url, workload[0], 2)  # the server's first request imports what serving needs
        rows = []
        for concurrency in CONCURRENCY:
            pairs = [measure_pair(url, process.pid, engine, workload, concurrency, args.max_tokens)
                     for _ in range(args.repeats)]
            rows.append(row(concurrency, pairs))
        tokens_per_chunk = pairs[0][0]["tokens_per_chunk"]  # greedy: the same texts in every run
    finally:
        process.terminate()
        process.wait(timeout=60)
    report("serve_load", rows, note=f"k3-tiny fp32, {args.requests} streamed completions of {args.max_tokens} tokens "
                                    f"({tokens_per_chunk:.2f} per chunk), medians of {args.repeats} runs; offline: "
                                    "an Engine on the same prompts in the same closed loop")


if __name__ == "__main__":
    main()
