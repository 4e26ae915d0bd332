"""Batch evaluation over JSONL files: `python -m k3jax.eval` (see README, "Evaluate").

`evaluate(model, tokenizer, data, out, EvalOptions(...))` is the same job from Python. The modules:
`requests` (input lines -> token rows, bad lines -> error records), `batching` (length-sorted,
bucketed batches), `scoring` (the jitted, data-sharded forward), `job` (schedule, resume, output),
`generate` (the engine task), `output` (the results file), `multihost` (collectives), `progress`.
The job is an application above serve/ (its generate task runs the serving engine); the parts that
read, batch, score and write know nothing of serving (ARCHITECTURE.md, "Packages and arrows").
"""

from k3jax.eval.job import TASKS, EvalOptions, evaluate

__all__ = ["TASKS", "EvalOptions", "evaluate"]
