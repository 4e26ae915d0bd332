"""How long `python -m k3jax.serve` (the embedded k3-tiny) takes to answer its first request: on a
fresh install (an empty cache directory: the checkpoint is written and nothing is compiled yet) and
on a restart (the same directory: the checkpoint and the compiled steps are on disk).

    python -m benchmarks.cold_start [--rounds 2] [--speculative]

Each round starts the server in a new empty $K3JAX_CACHE (cold), stops it once the background
compilation is done (its log says "compiled N of N"), then starts it again in that directory (warm).
Times are from the process start to the URL being printed (`ready_s`) and to the first
/v1/completions answer of 8 tokens (`first_answer_s`); medians over the rounds. `--speculative`
serves with the embedded DSpark draft (`--speculative-config`, 7 tokens; cold_start_speculative.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

from benchmarks.report import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
URL = re.compile(r"at (http://\S+)/v1")
DONE = re.compile(r"compiled (\d+) of (\d+) step shapes")
SPECULATIVE = ["--speculative-config", json.dumps({"method": "dspark", "model": "k3-tiny-dspark",
                                                   "num_speculative_tokens": 7})]


def start(cache: str, args: list[str]) -> tuple[dict, subprocess.Popen]:
    """Starts the server on a free port; returns its timings and the process (still running)."""
    begin = time.perf_counter()
    env = {**os.environ, "K3JAX_CACHE": cache, "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    server = subprocess.Popen([sys.executable, "-m", "k3jax.serve", "--port", "0", *args], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, compiled = None, False
    for line in server.stdout:
        if (match := DONE.search(line)) is not None:
            compiled = match.group(1) == match.group(2)  # every shape compiled before the port opened
        if (match := URL.search(line)) is not None:
            url = match.group(1)
            break
    if url is None:
        raise RuntimeError(f"the server exited ({server.wait()}) before printing its URL")
    ready = time.perf_counter() - begin
    body = json.dumps({"model": "k3-tiny", "prompt": "Hello", "max_tokens": 8}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.load(response)
    assert answer["usage"]["completion_tokens"] >= 1
    return {"ready_s": ready, "first_answer_s": time.perf_counter() - begin, "compiled_before_ready": compiled}, server


def wait_for_compilation(server: subprocess.Popen, compiled: bool) -> float:
    """Reads the log until every step shape is compiled; returns the seconds that took (0 if it was done)."""
    if compiled:
        return 0.0
    begin = time.perf_counter()
    for line in server.stdout:
        if (match := DONE.search(line)) is not None and match.group(1) == match.group(2):
            return time.perf_counter() - begin
    raise RuntimeError("the server exited before compiling every step shape")


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=60)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--speculative", action="store_true", help="serve with the embedded DSpark draft")
    args = parser.parse_args(argv)
    server_args = SPECULATIVE if args.speculative else []
    runs = {"cold": [], "warm": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            timings, server = start(cache, server_args)
            timings["rest_compiled_after_s"] = timings["first_answer_s"] + wait_for_compilation(
                server, timings.pop("compiled_before_ready"))
            stop(server)
            runs["cold"].append(timings)
            timings, server = start(cache, server_args)
            timings.pop("compiled_before_ready")
            stop(server)
            runs["warm"].append(timings)
    rows = [{"start": kind, **{key: float(np.median([r[key] for r in rounds])) for key in rounds[0]}}
            for kind, rounds in runs.items()]
    for row in rows:
        row.setdefault("rest_compiled_after_s", float("nan"))
    served = "with --speculative-config " + SPECULATIVE[1] if args.speculative else "default options"
    report("cold_start_speculative" if args.speculative else "cold_start", rows,
           note=f"python -m k3jax.serve (k3-tiny, {served}), medians of {args.rounds}; "
                "cold: empty cache directory; warm: a restart on it")


if __name__ == "__main__":
    main()
