"""Runs the CPU benchmarks one after another, each in its own process (`make bench`).

    python -m benchmarks.run_all                                  # all of them (long: tens of minutes)
    python -m benchmarks.run_all --only compare_transformers      # a comma-separated selection
    python -m benchmarks.run_all --only compare_transformers -- --rounds 5   # arguments after -- go to each
    python -m benchmarks.run_all --list

Each benchmark prints its tables and writes its JSON to benchmarks/results/. A failing benchmark does
not stop the others; the summary at the end gives each one's status and wall time, and the exit code
is non-zero when any failed. The GPU checks are separate: bash benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# In run order: the side-by-side with transformers first (the headline figures), then the rest.
BENCHMARKS = (
    "compare_transformers",  # needs a Python with torch + transformers (benchmarks/README.md)
    "tiny_decode",
    "train_moe",
    "engine_throughput",
    "batch_invariant",
    "sampling_noise",
    "structured_overhead",
    "grammar_compile_stall",
    "image_prefill",
    "kda_chunked_vs_recurrent",
    "sequence_parallel_prefill",
    "long_context",
    "max_model_len",
    "session_retention",
    "kv_offload",
    "decode_compile_time",
    "dspark_speedup",
    "eval_loglikelihood",
    "engine_fp8_agreement",
    "convert_throughput",
    "serve_load",
    "engine_contention",
    "cold_start",
)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description="Runs the CPU benchmarks (python -m benchmarks.NAME each).")
    parser.add_argument("--only", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the benchmark names and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(BENCHMARKS))
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    env = {**os.environ, "PYTHONPATH": REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    status = []
    for name in names:
        print(f"\n===== benchmarks.{name}", flush=True)
        start = time.perf_counter()
        code = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *extra], cwd=REPO, env=env).returncode
        status.append((name, code, time.perf_counter() - start))
    print("\n===== summary")
    for name, code, seconds in status:
        print(f"{name:28s} {'ok' if code == 0 else f'FAILED ({code})':12s} {seconds:7.0f} s")
    return 1 if any(code for _, code, _ in status) else 0


if __name__ == "__main__":
    sys.exit(main())
