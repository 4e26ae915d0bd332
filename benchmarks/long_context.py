"""Long-context correctness (issue 25): a 64K-token prompt on k3-tiny (fp32), prefilled in chunks
through the serving engine's paged step, gives the full forward's logits at its last positions.

- Engine side: `serve.runner.Runner` as the engine drives it, one sequence in slot 1: the prompt in
  prefill chunks of CHUNK tokens into MLA pages and a KDA slot, then DECODE teacher-forced decode
  steps (the prompt's last position and the DECODE after it are compared).
- Reference: `K3Model.logits`, one causal forward over the whole sequence, no cache and no pages.
- Reported: the largest |difference| over the compared positions against the largest |logit| (the
  scale fp32's error grows with), greedy agreement, NaN or inf anywhere in either side's logits, and
  each side's wall time. The model is the embedded k3-tiny (trained weights: logits with structure),
  the tokens random ids; its MLA has no RoPE, so nothing in it depends on a trained context length.
  Too slow for make test on 2 cores (the full forward's attention does T x T work per MLA layer); the
  same property at short lengths is tests/serve/test_engine.py's.

    python -m benchmarks.long_context [--tokens 65536]
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

CHUNK = 4096  # prefill tokens per step (every chunk the same length: one compiled shape)
DECODE = 8  # teacher-forced decode steps after the prompt
PAGE = 16


def engine_logits(model, tokens: list[int], prompt_len: int) -> np.ndarray:
    """float32 [DECODE + 1, vocab]: the logits after the prompt (prefilled in chunks) and after each
    of the next DECODE tokens (decoded one at a time), through the paged step."""
    pages = list(range(1, -(-len(tokens) // PAGE) + 1))
    runner = Runner(model, CacheLayout(PAGE, len(pages) + 1, 2), max_model_len=len(pages) * PAGE)
    for start in range(0, prompt_len, CHUNK):
        chunk = tokens[start:min(start + CHUNK, prompt_len)]
        out, _ = runner.run([(chunk, start, 1, pages)], 1, len(chunk))
    logits = [np.asarray(out[0], np.float32)]
    for position in range(prompt_len, prompt_len + DECODE):
        out, _ = runner.run([([tokens[position]], position, 1, pages)], 1, 1)
        logits.append(np.asarray(out[0], np.float32))
    return np.stack(logits)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=65536, help="prompt length (a multiple of the chunk)")
    args = parser.parse_args(argv)
    if args.tokens % CHUNK:
        parser.error(f"--tokens must be a multiple of {CHUNK}")
    model = from_pretrained(default_model_dir(), dtype="float32")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.vocab_size, args.tokens + DECODE).tolist()

    start = time.perf_counter()
    engine = engine_logits(model, tokens, args.tokens)
    engine_s = time.perf_counter() - start
    start = time.perf_counter()
    full = model.logits([tokens])[0]  # [T + DECODE, vocab]
    reference_s = time.perf_counter() - start
    reference = full[args.tokens - 1:args.tokens + DECODE]

    difference = float(np.abs(engine - reference).max())
    scale = float(np.abs(reference).max())
    row = {"prompt_tokens": args.tokens, "chunk": CHUNK, "positions": DECODE + 1,
           "max_abs_difference": difference, "max_abs_logit": scale, "relative": difference / scale,
           "argmax_agree": int((engine.argmax(-1) == reference.argmax(-1)).sum()),
           "non_finite": int((~np.isfinite(engine)).sum() + (~np.isfinite(full)).sum()),
           "engine_s": round(engine_s, 1), "full_forward_s": round(reference_s, 1)}
    report("long_context", [row], note="k3-tiny (embedded weights) fp32, chunked paged prefill vs one full forward")


if __name__ == "__main__":
    main()
