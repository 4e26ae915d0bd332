"""python -m k3jax.train: trains the embedded k3-tiny and writes it where `LLM()` loads it by default.

    python -m k3jax.train [--out k3jax/weights] [--steps 400] [--seed 0] [--stage all|text|vision|draft]   (make weights)

The default (`all`, what `make weights` runs) is the text stage, then the vision stage; together they
write the shipped k3jax/weights/k3-tiny. The text stage trains the decoder on the chat corpus and
writes OUT/k3-tiny (config.json, bf16 safetensors with MXFP4 experts, the byte-level tokenizer) and
OUT/k3-tiny/training.json: the options, the training time, the loss curve, held-out perplexity of the
written checkpoint against the unigram baseline, the shares of greedy chat replies that close their
markers and (tool calls) that name the topic asked, the share of replies to a tool's result that quote it, the
shares of replies to training questions and greetings that give the trained reply, and each MoE
layer's expert load over the last 20 steps. The vision stage (`k3jax.train.vision`) then
trains the tiny vision tower and projector against the frozen text model, adds them to OUT/k3-tiny
beside the text tensors (checked to be the text stage's byte for byte) and adds to training.json,
under "vision", its options, time, losses and the held-out caption accuracy against chance.
`--stage vision` runs it alone on the checkpoint already in OUT (replacing a tower there), `--stage
text` writes the text model alone. `--stage draft` distills the DSpark draft for the checkpoint in OUT
(`k3jax.train.draft`) and writes OUT/k3-tiny-dspark with its training.json. Deterministic given the
seed (on one machine: XLA:CPU's reductions are fixed for a given instruction set); training.json's
times differ from run to run.

The shipped tower: see training.json's "vision" and `k3jax.train.vision`.
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
from convert.reader import SafetensorsReader
from convert.vision_layout import PREFIXES as VISION_PREFIXES
from k3jax.loading import from_pretrained
from k3jax.dspark.config import DSparkConfig
from k3jax.dspark.model import shared_head
from k3jax.presets import DRAFT_PRESETS, PRESETS
from k3jax.train import corpus, draft, metrics, vision
from k3jax.train.target import TrainOptions, pretrained, train, training_config
from k3jax.vision.config import ImageProcessorConfig, vision_config

MODEL = "k3-tiny"
DRAFT = "k3-tiny-dspark"
WEIGHTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights")


def text_figures(model, seed: int) -> dict:
    """The text model's figures: held-out perplexity against the unigram baseline; the shares of
    greedy replies to held-out conversations that close their markers, (tool calls) that name the
    topic asked and (replies to a tool's result) that quote it; the shares of replies to training
    questions ("What is {title}?", both modes) and greetings that give the trained reply."""
    cfg = training_config(PRESETS[MODEL])
    tokenizer = corpus.byte_tokenizer(cfg)
    trained = corpus.conversations(False, seed)
    train_tokens = np.concatenate([c.render(tokenizer) for c in trained])
    held_out = corpus.conversations(True, seed)
    held_lists = [c.render(tokenizer) for c in held_out]
    asked = [c for c in trained if c.tools is None and c.topic is not None
             and c.messages[0]["content"] == corpus.QUESTIONS[1].format(c.topic)]
    greetings = list({(c.messages[0]["content"], c.thinking): c for c in trained if c.topic is None}.values())
    return dict(held_out_perplexity=metrics.perplexity(model, held_lists),
                unigram_perplexity=corpus.unigram_perplexity(train_tokens, np.concatenate(held_lists), cfg.vocab_size),
                **metrics.reply_figures(model, tokenizer, held_out),
                held_out_conversations=len(held_out),
                **metrics.recall_figures(model, tokenizer, asked + greetings))


def ship(out: str, params: nnx.State, report: dict) -> dict:
    """Exports the text stage's `params` to OUT/k3-tiny, replacing what is there only once the new
    one is complete, measures it and writes training.json: `report`, with the text figures added.
    Returns the report."""
    path, partial = os.path.join(out, MODEL), os.path.join(out, f".{MODEL}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    export.write_checkpoint(partial, PRESETS[MODEL], {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(params)})
    model = from_pretrained(partial, dtype="float32")  # what LLM() serves: bf16 / MXFP4 weights
    report.update(text_figures(model, report["options"]["seed"]))
    with open(os.path.join(partial, "training.json"), "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(partial, path)
    return report


def text_tensors(path: str) -> dict[str, tuple]:
    """The checkpoint's text tensors (all but `vision_tower.*` / `mm_projector.*`) as stored: name ->
    dtype, shape and bytes."""
    reader = SafetensorsReader(path)
    return {name: (str(array.dtype), array.shape, np.ascontiguousarray(array).tobytes())
            for name in reader.names() if not name.startswith(VISION_PREFIXES)
            for array in [reader.read(name)]}


def vision_stage(out: str, options: vision.VisionOptions) -> dict:
    """Trains the tower against OUT/k3-tiny's frozen text model and ships the checkpoint with it: the
    text tensors byte for byte as they were (checked), training.json's text report kept and the vision
    stage's put under "vision" (a previous one replaced)."""
    path, partial = os.path.join(out, MODEL), os.path.join(out, f".{MODEL}.partial")
    with open(os.path.join(path, "training.json")) as f:
        report = json.load(f)
    cfg = training_config(PRESETS[MODEL])
    tokenizer = corpus.byte_tokenizer(cfg)
    graphdef, params = pretrained(path, cfg)
    vcfg = vision_config(cfg)
    images = vision.Stream(tokenizer, vcfg, ImageProcessorConfig.from_pretrained(path), options.seed)
    start = time.time()
    _, tower, history = vision.train(graphdef, params, vcfg, images, options)
    report["vision"] = {"options": dataclasses.asdict(options), "train_seconds": round(time.time() - start, 1),
                        **history}
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(path, partial)
    export.add_vision_tensors(partial, vcfg, vision.tower_arrays(tower))
    if text_tensors(partial) != text_tensors(path):
        raise RuntimeError("adding the vision tower changed the text tensors")
    model = from_pretrained(partial, dtype="float32")  # as LLM() serves it: bf16 weights
    cases = vision.held_out(options.held_out, options.seed)
    report["vision"]["caption_accuracy"] = vision.caption_accuracy(model, tokenizer, cases)
    with open(os.path.join(partial, "training.json"), "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(path)
    os.rename(partial, path)
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=WEIGHTS)
    parser.add_argument("--steps", type=int, default=TrainOptions.steps)
    parser.add_argument("--seed", type=int, default=TrainOptions.seed)
    parser.add_argument("--stage", choices=("all", "text", "vision", "draft"), default="all",
                        help="all (text then vision: the shipped k3-tiny), text, vision (a tower for the "
                             "checkpoint in OUT, its text model frozen) or draft (the DSpark draft, distilled "
                             "from the checkpoint in OUT)")
    parser.add_argument("--vision-steps", type=int, default=vision.VisionOptions.steps)
    parser.add_argument("--draft-steps", type=int, default=draft.DraftOptions.steps)
    args = parser.parse_args(argv)
    if args.stage == "draft":
        report = draft_stage(args.out, draft.DraftOptions(steps=args.draft_steps, seed=args.seed))
        print(json.dumps({k: v for k, v in report.items() if k != "loss"}, indent=1))
        return
    if args.stage != "vision":
        text_stage(args.out, TrainOptions(steps=args.steps, seed=args.seed))
    if args.stage != "text":
        report = vision_stage(args.out, vision.VisionOptions(steps=args.vision_steps, seed=args.seed))
        print(json.dumps({k: v for k, v in report["vision"].items() if not k.endswith("loss")}, indent=1))


def draft_stage(out: str, options: draft.DraftOptions) -> dict:
    """Distills the k3-tiny-dspark draft from OUT/k3-tiny as served by default (bf16 activations) and
    writes it to OUT/k3-tiny-dspark with training.json (options, data and training time, losses, the
    last step's accuracy by block offset)."""
    # bf16: distilled from the fp32 target, the draft kept 6.0 drafts per window under an fp32 target
    # but 1.9 under the bf16 one (which leaves the fp32 continuations at near-ties); from the bf16
    # target it keeps 4.9 under the fp32 target and 5.3 under the bf16 one (batch 1,
    # benchmarks/dspark_speedup.py)
    target = from_pretrained(os.path.join(out, MODEL), dtype="bfloat16")
    cfg = DSparkConfig.from_dict(DRAFT_PRESETS[DRAFT])
    tokenizer = corpus.byte_tokenizer(training_config(PRESETS[MODEL]))
    start = time.time()
    data = draft.distillation_data(target, cfg, tokenizer, corpus.conversations(False, options.seed)[:options.prompts],
                                   options.new_tokens)
    data_seconds, start = time.time() - start, time.time()
    module, history = draft.train(cfg, shared_head(target), data, options)
    report = {"options": dataclasses.asdict(options), "data_seconds": round(data_seconds, 1),
              "train_seconds": round(time.time() - start, 1), "loss": [round(x, 4) for x in history["loss"]],
              "last_accuracy_by_offset": [round(x, 3) for x in history["last_accuracy"]]}
    path, partial = os.path.join(out, DRAFT), os.path.join(out, f".{DRAFT}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    export.write_draft(partial, DRAFT_PRESETS[DRAFT], {k: np.asarray(v.get_value())
                                                        for k, v in nnx.to_flat_state(nnx.state(module))})
    with open(os.path.join(partial, "training.json"), "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(partial, path)
    return report


def text_stage(out: str, options: TrainOptions) -> None:
    cfg = training_config(PRESETS[MODEL])
    tokenizer = corpus.byte_tokenizer(cfg)
    rows = corpus.Batches(corpus.conversations(False, options.seed), tokenizer, options.length, options.seed)
    start = time.time()
    params, history = train(cfg, rows, options)
    report = {"options": dataclasses.asdict(options), "train_seconds": round(time.time() - start, 1),
              "loss": [round(x, 4) for x in history["loss"]], "expert_load": history["expert_load"].tolist()}
    report = ship(out, params, report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("loss", "expert_load")}, indent=1))


if __name__ == "__main__":
    main()
