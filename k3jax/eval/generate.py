"""The generate task: prompts through the serving engine (continuous batching, paged caches), with
each line's own sampling parameters.

Each process drives one engine on a mesh of its own devices (its rows split over that mesh's `data`),
and the processes split the prompts between them (data parallelism across hosts). Prompts go in rounds of
`batch_size` per process; after each round the processes exchange their finished lines, so the
output grows as the job runs and a restart redoes at most one round.
"""

from __future__ import annotations

import math

from k3jax.eval import multihost
from k3jax.eval.progress import log
from k3jax.eval.requests import Request
from k3jax.model import K3Model
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams

OUTPUT_FIELDS = ("text", "token_ids", "finish_reason")


def run_generate(model: K3Model, tokenizer, pending: list[Request], emit, options, max_length: int) -> dict:
    engine_options = {"max_model_len": max_length, "max_num_seqs": options.batch_size, **options.engine_options}
    engine = Engine(model, EngineOptions(**engine_options), tokenizer=tokenizer)
    size = options.batch_size
    rounds = int(multihost.allgather_ints([math.ceil(len(pending) / size)]).max())
    for k in range(rounds):
        emit(_round(engine, pending[k * size:(k + 1) * size]))
    return {"rounds": rounds}


def _round(engine, requests: list[Request]) -> list[dict]:
    records, running = [], {}
    for request in requests:
        try:
            params = SamplingParams(**request.params)
            running[engine.add_request(request.prompt, params)] = request
        except (TypeError, ValueError) as e:  # unknown or invalid parameters, a prompt too long, ...
            log(f"line {request.line}: {e}")
            records.append({"id": request.id, "line": request.line, "error": str(e)})
    finished = {}
    while len(finished) < len(running):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    for request_id, request in running.items():
        output = finished[request_id]
        records.append({"id": request.id, "line": request.line, "text": output.text,
                        "token_ids": list(output.token_ids), "finish_reason": output.finish_reason})
    return records
