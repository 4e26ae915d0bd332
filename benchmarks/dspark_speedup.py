"""Speculative decoding on k3-tiny (fp32, CPU): the cost of one verify step (a window of 8), of the KDA
commit that replays the accepted tokens, and of one proposal by the synthetic DSpark draft, each
against one decode step at batch 1, 8 and 32; end-to-end greedy tokens/s with an oracle drafter (it
proposes the target's own continuation, so every draft is accepted) against plain decoding; and the
trained draft (k3jax/weights/k3-tiny-dspark, `python -m k3jax.train --stage draft`) beside the
trained k3-tiny on held-out chat prompts, against plain decoding in the same run at batch 1 and 8
(`--dtype bfloat16`: target and draft in bf16, as served by default, written as
dspark_trained_speedup_bf16; there a window may round a near-tie otherwise than one-token steps, so
the outputs equal to plain decoding are counted, where fp32 asserts them all).

    python -m benchmarks.dspark_speedup [--only trained] [--draft DIR] [--dtype float32|bfloat16]

The oracle isolates what the engine's speculative path costs and gains (verify, accept, KDA commit,
host bookkeeping); the trained draft adds its own forward and accepts fewer.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import jax
import numpy as np

from benchmarks.report import report
from convert import synth
from k3jax.config import K3Config
from k3jax.loading import from_pretrained
from k3jax.model import K3Model
from k3jax.presets import PRESETS
from k3jax.train import corpus
from k3jax.train.target import training_config
from serve.cache import CacheLayout
from serve.dspark.speculator import DSparkSpeculator, ScriptedSpeculator
from serve.engine import Engine, EngineOptions
from serve.llm import default_model_dir
from serve.runner import Runner
from serve.sampling import SamplingParams
from serve.scheduler import Request

K = 7
BATCHES = (1, 8, 32)
REPEATS = 20
NEW_TOKENS = 96


def median_ms(fn) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def step_rows(model) -> list[dict]:
    page_size, context = 16, 64
    pages_per_row = (context + K + 1) // page_size + 1
    layout = CacheLayout(page_size, max(BATCHES) * pages_per_row + 1, max(BATCHES) + 1)
    with tempfile.TemporaryDirectory() as draft_dir:
        synth.main(["--preset", "k3-tiny-dspark", "--out", draft_dir])
        draft = DSparkSpeculator.load(draft_dir, model, num_speculative_tokens=K)
    runner = Runner(model, layout, max_model_len=context + 2 * page_size, taps=draft.taps)
    draft.bind(runner, engine_seed=0)
    rows = []
    for batch in BATCHES:
        table = [list(range(1 + i * pages_per_row, 1 + (i + 1) * pages_per_row)) for i in range(batch)]
        decode = [([1], context, 1 + i, table[i]) for i in range(batch)]
        window = [([1] * (K + 1), context, 1 + i, table[i]) for i in range(batch)]
        requests = [Request(str(i), [1] * (context + 1), SamplingParams(temperature=0.0), i) for i in range(batch)]
        for request, pages in zip(requests, table):
            request.computed, request.pages = context, pages
        _, _, records = runner.verify(window, batch, K + 1)
        slots, accepted = np.arange(1, batch + 1, dtype=np.int32), np.full(batch, K // 2 + 1, np.int32)
        decode_ms = median_ms(lambda: runner.run(decode, batch, 1)[0])  # noqa: B023
        verify_ms = median_ms(lambda: runner.verify(window, batch, K + 1)[0])  # noqa: B023
        commit_ms = median_ms(lambda: (runner.commit(records, slots, accepted), runner.pools)[1])  # noqa: B023
        propose_ms = median_ms(lambda: draft.propose(requests, batch)[0])  # noqa: B023
        rows.append({"batch": batch, "decode_ms": decode_ms, "verify_vs_decode": verify_ms / decode_ms,
                     "commit_vs_decode": commit_ms / decode_ms, "draft_propose_vs_decode": propose_ms / decode_ms})
    return rows


def generate(engine, prompt) -> tuple[list[int], float]:
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    start, tokens = time.perf_counter(), []
    while engine.has_unfinished():
        for output in engine.step():
            tokens = output.token_ids
    return tokens, time.perf_counter() - start


def end_to_end_rows(model) -> list[dict]:
    options = EngineOptions(max_model_len=256, max_num_seqs=1, max_num_batched_tokens=64, block_size=16)
    prompt = np.random.default_rng(0).integers(0, 512, 32).tolist()
    plain = Engine(model, options)
    plain.warmup()
    reference, _ = generate(plain, prompt)
    plain_s = float(np.median([generate(plain, prompt)[1] for _ in range(3)]))
    oracle = ScriptedSpeculator(K, lambda request: reference[len(request.output):])
    speculative = Engine(model, options, speculator=oracle)
    speculative.warmup()
    tokens, _ = generate(speculative, prompt)
    assert tokens == reference, "speculation changed the greedy output"
    spec_s = float(np.median([generate(speculative, prompt)[1] for _ in range(3)]))
    stats = speculative.stats()
    return [{"batch": 1, "new_tokens": NEW_TOKENS, "plain_tok_s": NEW_TOKENS / plain_s,
             "oracle_tok_s": NEW_TOKENS / spec_s, "speedup": plain_s / spec_s,
             "mean_accepted_length": stats["spec_mean_accepted_length"]}]


def timed(engine, prompts) -> tuple[list[list[int]], float, dict]:
    """Greedy outputs of `prompts` run together, their wall time and the engine's speculative
    counters over this run alone."""
    before = engine.stats()
    start = time.perf_counter()
    outputs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)]
                              * len(prompts))
    seconds = time.perf_counter() - start
    after = engine.stats()
    return [o.token_ids for o in outputs], seconds, {k: after[k] - before.get(k, 0) for k in
                                                     ("spec_num_drafts", "spec_num_accepted_tokens") if k in after}


def trained_rows(draft_dir: str, dtype: str = "float32") -> list[dict]:
    """The trained draft against plain decoding, both on the trained k3-tiny (`dtype`; the draft
    takes the target's), greedy, on the first 8 held-out chat prompts: batch 1 runs the first two one
    at a time, batch 8 all eight together. Each engine runs everything once untimed first (compiles),
    then timed."""
    target = from_pretrained(default_model_dir(), dtype=dtype)
    tokenizer = corpus.byte_tokenizer(training_config(PRESETS["k3-tiny"]))
    prompts = [c.prompt(tokenizer) for c in corpus.conversations(True, 0)[:8]]
    options = EngineOptions(max_model_len=1024, max_num_seqs=8, block_size=16)
    spec_options = dataclasses.replace(options, speculative_config={
        "method": "dspark", "model": draft_dir, "num_speculative_tokens": K})
    runs = {1: [prompts[:1], prompts[1:2]], 8: [prompts]}
    figures = {}
    for name, engine_options in (("plain", options), ("draft", spec_options)):
        engine = Engine(target, engine_options)
        for batch, groups in runs.items():
            for group in groups:
                timed(engine, group)
            results = [timed(engine, group) for group in groups]
            figures[name, batch] = ([t for r in results for t in r[0]], sum(r[1] for r in results),
                                    {k: sum(r[2][k] for r in results) for k in results[0][2]})
    rows = []
    for batch, groups in runs.items():
        (plain_tokens, plain_s, _), (tokens, spec_s, counts) = figures["plain", batch], figures["draft", batch]
        same = [a == b for a, b in zip(tokens, plain_tokens)]
        # fp32: speculation must not change a greedy token. bf16: a verify window rounds otherwise than
        # one-token steps, and a near-tie in a router or the LM head then flips (on the shipped k3-tiny
        # the first flip, 37 tokens into a reply, had plain decoding 0.15 from fp32's logprob and the
        # window 0.006), so count the outputs that stayed equal instead.
        assert dtype != "float32" or all(same), "speculation changed the greedy output"
        generated = sum(len(t) for t in tokens)
        accepted = counts["spec_num_accepted_tokens"] / counts["spec_num_drafts"]
        rows.append({"batch": batch, "new_tokens": generated, "plain_tok_s": generated / plain_s,
                     "draft_tok_s": generated / spec_s, "speedup": plain_s / spec_s,
                     "accepted_drafts_per_window": accepted, "mean_accepted_length": 1 + accepted,
                     "outputs_equal_to_plain": f"{sum(same)}/{len(same)}"})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("trained",), help="run only the trained draft's figures")
    parser.add_argument("--draft", default=os.path.join(os.path.dirname(default_model_dir()), "k3-tiny-dspark"),
                        help="the trained draft's checkpoint directory")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the trained target's (and so the draft's) dtype")
    args = parser.parse_args(argv)
    if args.only is None:
        model = K3Model.random(K3Config.from_preset("k3-tiny"), dtype="float32", seed=0)
        report("dspark_verify_cost", step_rows(model),
               note=f"k3-tiny fp32, {REPEATS} runs, median; a window of {K + 1} after 64 cached tokens; "
                    f"commit replays {K // 2 + 1} tokens; the k3-tiny-dspark draft proposes {K}")
        report("dspark_oracle_speedup", end_to_end_rows(model),
               note=f"k3-tiny fp32, greedy, {NEW_TOKENS} tokens, K={K}, oracle drafter; median of 3")
    suffix, precision = ("", "fp32") if args.dtype == "float32" else ("_bf16", "bf16")
    report(f"dspark_trained_speedup{suffix}", trained_rows(args.draft, args.dtype),
           note=f"trained k3-tiny {precision} and the trained k3-tiny-dspark draft, greedy, {NEW_TOKENS} tokens per "
                f"held-out chat prompt, K={K}; batch 1: 2 prompts one at a time, batch 8: 8 together; one timed run "
                "after an untimed one; mean_accepted_length counts the target's own token")


if __name__ == "__main__":
    main()
