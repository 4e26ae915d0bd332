"""The generate task: prompts through the serving engine (continuous batching, paged caches), with
each line's own sampling parameters.

Each process drives one engine on a mesh of its own devices (its rows split over that mesh's `data`),
and the processes split the prompts between them (data parallelism across hosts). Prompts go in rounds of
`batch_size` per process; after each round the processes exchange their finished lines, so the
output grows as the job runs and a restart redoes at most one round.
"""

from __future__ import annotations

import functools
import math

from k3jax.eval import multihost
from k3jax.eval.progress import log
from k3jax.eval.requests import Request
from k3jax.model import K3Model
from serve.chat.encoding import tokenize_messages
from serve.engine import Engine, EngineOptions
from serve.multimodal import chat_prompt
from serve.sampling import SamplingParams

OUTPUT_FIELDS = ("text", "token_ids", "finish_reason")


def run_generate(model: K3Model, tokenizer, pending: list[Request], emit, options, max_length: int) -> dict:
    engine_options = {"max_model_len": max_length, "max_num_seqs": options.batch_size, **options.engine_options}
    engine = Engine(model, EngineOptions(**engine_options), tokenizer=tokenizer)
    size = options.batch_size
    rounds = int(multihost.allgather_ints([math.ceil(len(pending) / size)]).max())
    prompt_of = functools.partial(_prompt, model, tokenizer, options.allowed_local_media_path)
    for k in range(rounds):
        emit(_round(engine, pending[k * size:(k + 1) * size], prompt_of))
    return {"rounds": rounds}


def _prompt(model: K3Model, tokenizer, allowed_local_media_path: str | None, request: Request):
    """The engine's prompt of a line: its prompt as it is, or its chat rendered in K3's format with its
    image_url parts read (data: URLs, file:// under allowed_local_media_path) and expanded, as the
    server's chat endpoint does. ValueErrors name the bad part."""
    if request.messages is None:
        return request.prompt
    ids = tokenize_messages(tokenizer, request.messages, thinking=request.thinking)
    processor = None if model.vision is None else model.vision.processor
    return chat_prompt(ids, request.messages, tokenizer, processor, allowed_local_media_path=allowed_local_media_path)


def _round(engine, requests: list[Request], prompt_of) -> list[dict]:
    records, running = [], {}
    for request in requests:
        try:
            params = SamplingParams(**request.params)
            running[engine.add_request(prompt_of(request), params)] = request
        except (TypeError, ValueError) as e:  # unknown or invalid parameters, a prompt too long, a bad image, ...
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
