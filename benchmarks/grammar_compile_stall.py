"""What a large JSON schema's compile costs the other requests (serve/structured.py, issue 23), on
the embedded k3-tiny behind the server's AsyncEngine: while one free request decodes, a request with
a fresh SCHEMA_PROPERTIES-property schema is submitted and, 10 ms later, a second free request.
Timed: the second request's time to first token, and the longest gap between the running
request's tokens in that window (its usual gap, one step, alongside).

Two paths, interleaved rounds, medians: `engine_thread` submits straight to the engine, whose
add_request compiles the grammar on the engine thread (how every request was served before);
`worker_thread` goes through the HTTP server's submit (serve/api_common.py), which compiles it in
a worker thread first. Each round's schema is new (its property names carry the round), so no
compiled grammar is reused.

    python -m benchmarks.grammar_compile_stall
"""

from __future__ import annotations

import asyncio
import time

import jax
import llguidance
import numpy as np

from benchmarks.report import report
from serve import api_common
from serve.async_engine import AsyncEngine
from serve.llm import LLM
from serve.sampling import SamplingParams
from serve.structured import StructuredOutputsParams

PROMPT = list(range(3, 35))  # 32 tokens
SCHEMA_PROPERTIES, ROUNDS = 1500, 5
FREE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
PATHS = {"engine_thread": lambda engine, requests: engine.submit(requests),
         "worker_thread": api_common.submit}


def large_schema(tag: str) -> dict:
    """Objects, arrays of objects, patterned strings and enums, SCHEMA_PROPERTIES of them."""
    kinds = [lambda i: {"type": "string", "pattern": f"[a-z]{{3,{5 + i % 7}}}"},
             lambda i: {"type": "array", "items": {"type": "object", "required": ["a"],
                                                   "properties": {"a": {"type": "integer", "minimum": i},
                                                                  "b": {"enum": [f"v{j}" for j in range(i % 11 + 2)]}}}},
             lambda i: {"type": "object", "properties": {f"k{j}": {"type": "number"} for j in range(6)},
                        "required": ["k0", "k1", "k2"]}]
    properties = {f"{tag}_{i}": kinds[i % 3](i) for i in range(SCHEMA_PROPERTIES)}
    return {"type": "object", "properties": properties, "required": list(properties)}


async def one_round(engine: AsyncEngine, path: str, tag: str) -> dict:
    running = await engine.submit([(PROMPT, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))])
    arrivals = []

    async def read():
        async for _, output in running:
            arrivals.extend([time.perf_counter()] * len(output.token_ids))
    reader = asyncio.create_task(read())
    while len(arrivals) < 8:  # decoding steadily
        await asyncio.sleep(0.005)
    constrained = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=large_schema(tag)))
    submitted = asyncio.create_task(PATHS[path](engine, [(PROMPT, constrained)]))
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    free = await engine.submit([(PROMPT, FREE)])
    async for _ in free:
        break
    ttft = time.perf_counter() - start
    async for _ in await submitted:
        pass
    window_end = time.perf_counter()
    running.abort()
    reader.cancel()
    times = np.array(arrivals)
    gaps = np.diff(times)
    in_window = gaps[(times[1:] > start - 0.01) & (times[:-1] < window_end)]
    return {"ttft_ms": 1e3 * ttft, "running_max_gap_ms": 1e3 * float(in_window.max(initial=0.0)),
            "running_median_gap_ms": 1e3 * float(np.median(gaps[:8]))}


def compile_ms(engine: AsyncEngine) -> float:
    grammars = engine.engine.grammars
    start = time.perf_counter()
    grammars.compile(StructuredOutputsParams(json=large_schema("timing")))
    return 1e3 * (time.perf_counter() - start)


async def main_async() -> list[dict]:
    llm = LLM(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64)
    small = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    llm.engine.generate([PROMPT] * 2, [FREE, small])  # compiles the step shapes, masked ones too
    engine = AsyncEngine(llm.engine, max_queued_requests=8)
    engine.start()
    try:
        await one_round(engine, "worker_thread", "warmup")
        results = {path: [] for path in PATHS}
        for r in range(ROUNDS):
            for path in PATHS if r % 2 == 0 else list(PATHS)[::-1]:
                results[path].append(await one_round(engine, path, f"r{r}_{path}"))
        compile_time = compile_ms(engine)
    finally:
        engine.stop()
    return [{"path": path, "schema_compile_ms": compile_time,
             **{key: float(np.median([run[key] for run in runs])) for key in runs[0]}}
            for path, runs in results.items()]


def main() -> None:
    rows = asyncio.run(main_async())
    report("grammar_compile_stall", rows, note=f"k3-tiny, 512-token vocabulary, {SCHEMA_PROPERTIES}-property JSON "
                                               f"schema, llguidance {llguidance.__version__}, {ROUNDS} rounds, "
                                               f"medians, {jax.default_backend()}")


if __name__ == "__main__":
    main()
