"""Agent-session retention (`prompt_cache_key`, serve/sessions.py): the time to first token of each
turn of a 10-turn agent conversation, with its prefix pinned between turns and without, under the
same background traffic. Synthetic k3-tiny (random weights), prefix caching on in both arms.

The conversation starts with a 512-token prompt (system prompt and tools); every turn generates 32
tokens and the next turn resends everything with a 64-token tool result added (the last turn's
prompt: 1376 tokens). Between two turns, 10 background requests of 512 new tokens each touch more
pages than the pool holds, so an unpinned conversation is evicted by the LRU. Both arms see the
same conversation and the same background prompts; a round runs the conversation once per arm, the
order flipping each round, and the figures are medians over rounds.

    python -m benchmarks.session_retention [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from benchmarks.report import report
from k3jax.config import K3Config
from k3jax.model import K3Model
from serve.cache import page_bytes, slot_bytes
from serve.engine import Engine, EngineOptions
from serve.sessions import SessionParams

TURNS, FIRST, TOOL_RESULT, OUTPUT = 10, 512, 64, 32
BACKGROUND, BACKGROUND_TOKENS = 10, 512  # per gap between turns: 10 x 33 pages, more than the pool's 255
PAGE, PAGES = 16, 256


def run_turn(engine: Engine, prompt: list[int], params: SessionParams) -> tuple[float, object]:
    """(time to first token in ms, the final output) of one request run alone."""
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    ttft, final = None, None
    while final is None:
        for output in engine.step():
            if output.request_id == request_id:
                ttft = ttft if ttft is not None or not output.token_ids else time.perf_counter() - start
                final = output if output.finished else None
    return 1e3 * ttft, final


def conversation(engine: Engine, seed: int, key: str | None) -> list[tuple[int, float, int]]:
    """One 10-turn conversation with background traffic between turns: (prompt tokens, TTFT ms,
    cached prompt tokens) per turn."""
    engine.reset_prefix_cache()  # both arms start from the same empty cache
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 512, FIRST).tolist()
    params = SessionParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True, prompt_cache_key=key)
    background = SessionParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    turns = []
    for _ in range(TURNS):
        ttft, out = run_turn(engine, prompt, params)
        turns.append((len(prompt), ttft, out.num_cached_tokens))
        engine.generate([rng.integers(0, 512, BACKGROUND_TOKENS).tolist() for _ in range(BACKGROUND)],
                        [background] * BACKGROUND)
        prompt = prompt + out.token_ids + rng.integers(0, 512, TOOL_RESULT).tolist()
    return turns


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    cfg = K3Config.from_preset("k3-tiny")
    model = K3Model.random(cfg, dtype="bfloat16", seed=0)
    # pins may hold the last turn's 88 pages and its snapshot slot (in bf16 k3-tiny's KDA slot weighs 19
    # pages; the default budget, a quarter of the cache's bytes, holds 87 pages: one short)
    budget = slot_bytes(cfg, 2) + 100 * page_bytes(cfg, PAGE, 2)
    engine = Engine(model, EngineOptions(max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=512,
                                         max_prefill_chunk=512, block_size=PAGE, num_gpu_blocks=PAGES,
                                         enable_prefix_caching=True, session_cache_bytes=budget))
    engine.warmup()
    arms = {"retained": "agent", "evicted": None}
    conversation(engine, 0, "warm")  # compiles every shape both arms reach
    results = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            results[arm].append(conversation(engine, 1 + r, arms[arm]))
    rows = []
    for turn in range(TURNS):
        row = {"turn": turn + 1, "prompt_tokens": results["retained"][0][turn][0]}
        for arm in arms:
            row[f"{arm}_cached_tokens"] = int(np.median([c[turn][2] for c in results[arm]]))
            row[f"{arm}_ttft_ms"] = float(np.median([c[turn][1] for c in results[arm]]))
        row["speedup"] = row["evicted_ttft_ms"] / row["retained_ttft_ms"]
        rows.append(row)
    report("session_retention", rows, note=f"synthetic k3-tiny bf16, pages of {PAGE} tokens, {PAGES} pages, "
                                           f"{BACKGROUND} x {BACKGROUND_TOKENS}-token background requests between "
                                           f"turns, {args.rounds} interleaved rounds, medians, {jax.default_backend()}")


if __name__ == "__main__":
    main()
