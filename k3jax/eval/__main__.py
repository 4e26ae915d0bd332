"""`python -m k3jax.eval`: log-likelihood, perplexity or generation over a JSONL file, on one host or
many (run the same command on every host with --coordinator / --num-processes / --process-id).

    python -m k3jax.eval --model DIR --data requests.jsonl --task loglikelihood --mesh 8x2 \\
        --batch-size 32 --dtype bfloat16 --out results.jsonl
"""

from __future__ import annotations

import argparse
import json

import jax

import k3jax
from k3jax.eval.job import TASKS, EvalOptions, evaluate
from serve.llm import default_model_dir, load_tokenizer
from sharding import distributed
from sharding.mesh import DATA, make_mesh, parse_mesh


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m k3jax.eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the embedded k3-tiny)")
    p.add_argument("--data", required=True, help="input JSONL, one request per line")
    p.add_argument("--task", choices=TASKS, default="loglikelihood")
    p.add_argument("--out", required=True, help="output JSONL; an existing file is resumed")
    p.add_argument("--mesh", default="1x1", help="model x data, e.g. 8x2 (generate: data = number of processes)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step over all processes")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--max-length", type=int, help="tokens per row (perplexity: the window); "
                                                  "default min(max_position_embeddings, 4096)")
    p.add_argument("--stride", type=int, help="perplexity: new tokens scored per window (default max-length / 2)")
    p.add_argument("--no-sort", action="store_true", help="batch in input order instead of by length")
    p.add_argument("--no-progress", action="store_true", help="no progress line or summary on stderr")
    p.add_argument("--engine-options", default="{}",
                   help='generate: engine options as JSON, e.g. \'{"kv_cache_dtype": "fp8"}\'')
    p.add_argument("--allowed-local-media-path", help="generate: a directory file:// image URLs in `messages` "
                                                      "may read from (default: data: URLs only)")
    distributed.add_arguments(p)
    return p


def load_model(path: str, mesh_spec: str, dtype: str, task: str):
    """The model on the job's mesh. generate runs one engine per process, on a mesh of that process's
    own devices (`model` x `data` / processes), so there the data axis must divide over the processes."""
    if task != "generate":
        return k3jax.from_pretrained(path, dtype=dtype, mesh=make_mesh(mesh_spec))
    sizes, processes = parse_mesh(mesh_spec), jax.process_count()
    if sizes[DATA] % processes:
        raise SystemExit(f"k3jax.eval: generate runs one engine per process; --mesh {mesh_spec} has data="
                         f"{sizes['data']}, not a multiple of the {processes} process(es)")
    local = f"{sizes['model']}x{sizes['data'] // processes}"
    mesh = None if local == "1x1" else make_mesh(local, devices=jax.local_devices())
    return k3jax.from_pretrained(path, dtype=dtype, mesh=mesh)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    started = distributed.initialize(args.coordinator, args.num_processes, args.process_id)  # before any device use

    try:
        options = EvalOptions(args.task, args.batch_size, args.max_length, args.stride, sort=not args.no_sort,
                              progress=not args.no_progress, engine_options=json.loads(args.engine_options),
                              allowed_local_media_path=args.allowed_local_media_path)
    except ValueError as e:
        raise SystemExit(f"k3jax.eval: {e}") from None
    path = args.model or default_model_dir()
    summary = evaluate(load_model(path, args.mesh, args.dtype, args.task), load_tokenizer(path), args.data, args.out,
                       options)
    if started:
        jax.distributed.shutdown()
    return summary


if __name__ == "__main__":
    main()
