"""How long `python -m k3jax.serve` (the embedded k3-tiny) takes to answer its first request: on a
fresh install (an empty cache directory: the checkpoint is written and nothing is compiled yet) and
on a restart (the same directory: the checkpoint and the compiled steps are on disk).

    python -m benchmarks.cold_start [--rounds 2]

Each round starts the server in a new empty $K3JAX_CACHE (cold), stops it once the background
compilation is done (its log says "compiled N of N"), then starts it again in that directory (warm).
Times are from the process start to the URL being printed (`ready_s`) and to the first
/v1/completions answer of 8 tokens (`first_answer_s`); medians over the rounds.
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


def start(cache: str) -> tuple[dict, subprocess.Popen]:
    """Starts the server on a free port; returns its timings and the process (still running)."""
    begin = time.perf_counter()
    env = {**os.environ, "K3JAX_CACHE": cache, "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    server = subprocess.Popen([sys.executable, "-m", "k3jax.serve", "--port", "0"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = None
    for line in server.stdout:
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
    return {"ready_s": ready, "first_answer_s": time.perf_counter() - begin}, server


def wait_for_compilation(server: subprocess.Popen) -> float:
    """Reads the log until every step shape is compiled; returns the seconds that took."""
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
    args = parser.parse_args(argv)
    runs = {"cold": [], "warm": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as cache:
            timings, server = start(cache)
            timings["rest_compiled_after_s"] = timings["first_answer_s"] + wait_for_compilation(server)
            stop(server)
            runs["cold"].append(timings)
            timings, server = start(cache)
            stop(server)
            runs["warm"].append(timings)
    rows = [{"start": kind, **{key: float(np.median([r[key] for r in rounds])) for key in rounds[0]}}
            for kind, rounds in runs.items()]
    for row in rows:
        row.setdefault("rest_compiled_after_s", float("nan"))
    report("cold_start", rows, note=f"python -m k3jax.serve (k3-tiny, default options), medians of {args.rounds}; "
                                    "cold: empty cache directory; warm: a restart on it")


if __name__ == "__main__":
    main()
