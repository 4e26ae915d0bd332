"""python -m k3jax.train: trains the embedded k3-tiny and writes it where `LLM()` loads it by default.

    python -m k3jax.train [--out k3jax/weights] [--steps 120] [--seed 0]        (make weights)

Writes OUT/k3-tiny (config.json, bf16 safetensors with MXFP4 experts, the byte-level tokenizer) and
OUT/k3-tiny/training.json: the options, the training time, the loss curve, held-out perplexity of
the written checkpoint against the unigram baseline, the share of greedy chat replies that close
their markers, and each MoE layer's expert load over the last 20 steps. Deterministic given the seed
(on one machine: XLA:CPU's reductions are fixed for a given instruction set).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time

import numpy as np
from flax import nnx

from convert import export
from k3jax.loading import from_pretrained
from k3jax.presets import PRESETS
from k3jax.train import corpus, metrics
from k3jax.train.target import TrainOptions, train, training_config

MODEL = "k3-tiny"
WEIGHTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights")


def ship(out: str, params: nnx.State, report: dict) -> dict:
    """Exports `params` to OUT/k3-tiny (replacing what is there only once the new one is complete),
    measures it and writes training.json. Returns the report with the measurements."""
    cfg = training_config(PRESETS[MODEL])
    tokenizer = corpus.byte_tokenizer(cfg)
    train_tokens = np.concatenate([c.render(tokenizer) for c in corpus.conversations(False, report["options"]["seed"])])
    held_out = corpus.conversations(True, report["options"]["seed"])
    held_lists = [c.render(tokenizer) for c in held_out]
    path, partial = os.path.join(out, MODEL), os.path.join(out, f".{MODEL}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    export.write_checkpoint(partial, PRESETS[MODEL], {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)})
    model = from_pretrained(partial, dtype="float32")  # what LLM() serves: bf16 / MXFP4 weights
    report.update(
        held_out_perplexity=metrics.perplexity(model, held_lists),
        unigram_perplexity=corpus.unigram_perplexity(train_tokens, np.concatenate(held_lists), cfg.vocab_size),
        closing_share=metrics.closing_share(model, tokenizer, held_out),
        held_out_conversations=len(held_out))
    with open(os.path.join(partial, "training.json"), "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(partial, path)
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=WEIGHTS)
    parser.add_argument("--steps", type=int, default=TrainOptions.steps)
    parser.add_argument("--seed", type=int, default=TrainOptions.seed)
    args = parser.parse_args(argv)
    options = TrainOptions(steps=args.steps, seed=args.seed)
    cfg = training_config(PRESETS[MODEL])
    tokenizer = corpus.byte_tokenizer(cfg)
    rows = corpus.Batches(corpus.conversations(False, options.seed), tokenizer, options.length, options.seed)
    start = time.time()
    params, history = train(cfg, rows, options)
    report = {"options": dataclasses.asdict(options), "train_seconds": round(time.time() - start, 1),
              "loss": [round(x, 4) for x in history["loss"]], "expert_load": history["expert_load"].tolist()}
    report = ship(args.out, params, report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("loss", "expert_load")}, indent=1))


if __name__ == "__main__":
    main()
