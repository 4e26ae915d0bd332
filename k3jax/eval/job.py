"""The eval job: parse this process's slice, agree on one batch schedule across processes, run it,
and stream every result line to process 0, which appends it to the output and sorts the file by
input line at the end.

Resuming keeps results bit for bit: the schedule is planned over every request, finished or not,
and a batch runs unless all its requests are already in the output. A batch cut by a kill therefore
runs again with the same rows and shape, and only its missing lines are written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np

from k3jax.eval import batching, multihost
from k3jax.eval.output import Done, ResultsWriter, load_records
from k3jax.eval.progress import Progress, log
from k3jax.eval.requests import BadLine, Parser, Request, read_slice
from k3jax.eval.scoring import Scorer
from k3jax.model import K3Model

TASKS = ("loglikelihood", "perplexity", "generate")
DEFAULT_MAX_LENGTH = 4096


@dataclasses.dataclass
class EvalOptions:
    task: str = "loglikelihood"
    batch_size: int = 8  # rows per step over all processes (rounded up to a multiple of the data axis)
    max_length: int | None = None  # tokens per row; default min(max_position_embeddings, 4096)
    stride: int | None = None  # perplexity: new tokens per window; default max_length // 2
    sort: bool = True  # length-sorted batching
    progress: bool = True
    engine_options: dict = dataclasses.field(default_factory=dict)  # generate: EngineOptions keywords
    allowed_local_media_path: str | None = None  # generate: where file:// image URLs may point

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r} is not one of {TASKS}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")


def evaluate(model: K3Model, tokenizer, data: str, out: str, options: EvalOptions | None = None) -> dict:
    """Runs the job on every process (each with the same arguments) and returns its summary; the
    results are in `out` on process 0 when every process has returned."""
    options = options or EvalOptions()
    start = time.monotonic()
    first = multihost.process_index() == 0
    writer = ResultsWriter(out) if first else None  # cuts a partial last line
    done = Done(load_records(out)) if first else None
    if multihost.process_count() > 1:
        done = Done.from_json(multihost.broadcast_bytes(done.to_json().encode() if first else b"").decode())

    max_length = options.max_length or min(model.config.max_position_embeddings or DEFAULT_MAX_LENGTH,
                                           DEFAULT_MAX_LENGTH)
    stride = options.stride or max(max_length // 2, 1)
    requests, errors = _parse(Parser(options.task, tokenizer, model.config, max_length, stride), data, done)
    pending = [r for r in requests if not (done.has(r.id) or r.line in done.lines)]
    total = int(multihost.allgather_ints([len(pending)]).sum())
    progress = Progress(total, options.task, enabled=first and options.progress)
    emit = _Emitter(writer, progress)
    emit(errors)
    if options.task == "generate":
        from k3jax.eval.generate import run_generate  # noqa: PLC0415 (the engine only when asked for)

        stats = run_generate(model, tokenizer, pending, emit, options, max_length)
    else:
        stats = _run_scoring(Scorer(model), requests, done, emit, options, max_length)
    progress.close()
    summary = {"task": options.task, "results": emit.results, "errors": emit.errors, **stats}
    if first:
        summary["records"] = writer.finalize()
        if options.task == "perplexity":
            summary["corpus_perplexity"] = corpus_perplexity(load_records(out))
    multihost.barrier("k3jax.eval finished")
    seconds = time.monotonic() - start
    summary.update(seconds=round(seconds, 3), examples_per_s=round(emit.results / seconds, 3) if seconds else 0.0)
    if first and options.progress:
        log(json.dumps(summary))
    return summary


def _parse(parser: Parser, data: str, done: Done) -> tuple[list[Request], list[dict]]:
    """This process's requests, and the error records of its bad lines not yet in the output (each
    also reported on stderr). A repeated id is an error on every line after its first, over all
    processes' slices (ids key the resume, so they must be unique)."""
    requests, errors = [], []

    def reject(line, message, request_id=None):
        if line not in done.lines:
            log(f"line {line}: {message}")
            errors.append({"id": request_id, "line": line, "error": message})

    for line, text in read_slice(data, multihost.process_index(), multihost.process_count()):
        try:
            requests.append(parser.parse(line, text, owner=len(requests)))
        except BadLine as e:
            reject(line, str(e), getattr(e, "request_id", None))
    first: dict[str, int] = {}
    local = json.dumps([[r.id, r.line] for r in requests]).encode()
    for part in multihost.allgather_bytes(local):
        for rid, line in json.loads(part):
            key = json.dumps(rid)
            first[key] = min(first.get(key, line), line)
    unique = []
    for request in requests:
        key = json.dumps(request.id)
        if first[key] != request.line:
            reject(request.line, f"duplicate id {key} (first on line {first[key]})", request.id)
            continue
        for row in request.rows:
            row.owner = len(unique)
        unique.append(request)
    return unique, sorted(errors, key=lambda r: r["line"])


class _Emitter:
    """Brings every process's records to process 0 (a collective: all processes call it together)."""

    def __init__(self, writer: ResultsWriter | None, progress: Progress):
        self.writer, self.progress = writer, progress
        self.results = self.errors = 0

    def __call__(self, records: list[dict]) -> None:
        payload = "".join(json.dumps(r) + "\n" for r in records).encode()
        for part in multihost.allgather_bytes(payload):
            gathered = [json.loads(text) for text in part.decode().splitlines()]
            if self.writer is not None:
                self.writer.write(gathered)
            errors = sum("error" in r for r in gathered)
            self.errors += errors
            self.results += len(gathered) - errors
            self.progress.update(len(gathered) - errors)


def _run_scoring(scorer: Scorer, requests: list[Request], done: Done, emit, options: EvalOptions,
                 max_length: int) -> dict:
    processes = multihost.process_count()
    data = scorer.data_size
    if data % processes:
        raise ValueError(f"the mesh's data axis ({data}) must split over the {processes} processes")
    global_rows = math.ceil(options.batch_size / data) * data
    local_rows = global_rows // processes
    rows = [row for request in requests for row in request.rows]
    lengths = [len(row.tokens) for row in rows]
    sizes = batching.length_buckets(max_length, smallest=min(16, max_length))
    batches = batching.plan(lengths, local_rows, sizes, sort=options.sort)
    finished = {i for i, r in enumerate(requests) if done.has(r.id) or r.line in done.lines}
    runs = [any(rows[i].owner not in finished for i in b.rows) for b in batches]

    # One schedule for every process: step s pads to the longest of the processes' batches s and runs
    # if any process still needs its batch s.
    table = multihost.allgather_ints([v for b, run in zip(batches, runs) for v in (b.length, run)])
    table = table[:, :table.shape[1] // 2 * 2].reshape(processes, -1, 2)  # (a lone -1 pads an empty plan)
    step_lengths, step_runs = table[..., 0].max(axis=0), (table[..., 1] == 1).any(axis=0)

    totals = {i: 0.0 for i in range(len(requests))}
    counts = dict.fromkeys(totals, 0)
    greedy = dict.fromkeys(totals, True)
    left = dict.fromkeys(totals, 0)
    for row in rows:
        left[row.owner] += 1
    real = slots = 0
    for s in np.flatnonzero(step_runs):
        batch = batches[s] if s < len(batches) else None
        arrays = batching.pack(rows, batch, local_rows, int(step_lengths[s]))
        ll, is_greedy = scorer(*arrays)
        real, slots = real + int(np.sum(arrays[1])), slots + arrays[0].size
        records = []
        for i, r in enumerate(batch.rows if batch else ()):
            row = rows[r]
            owner = row.owner
            totals[owner] += float(ll[i])
            counts[owner] += len(row.tokens) - row.start
            greedy[owner] &= bool(is_greedy[i])
            left[owner] -= 1
            if left[owner] == 0 and owner not in finished:
                records.append(_record(options.task, requests[owner], totals[owner], counts[owner], greedy[owner]))
        emit(records)
    real, slots = multihost.allgather_ints([real, slots]).sum(axis=0)
    return {"steps": int(step_runs.sum()), "compiled_shapes": len(scorer.shapes),
            "padding_waste": round(1.0 - real / slots, 4) if slots else 0.0}


def _record(task: str, request: Request, total: float, count: int, is_greedy: bool) -> dict:
    if task == "loglikelihood":
        return {"id": request.id, "line": request.line, "loglikelihood": total, "is_greedy": is_greedy}
    return {"id": request.id, "line": request.line, "loglikelihood": total, "num_tokens": count,
            "perplexity": math.exp(-total / count)}


def corpus_perplexity(records: list[dict]) -> float | None:
    """exp of minus the total log-likelihood over the total scored tokens of every document."""
    records = [r for r in records if "num_tokens" in r]
    tokens = sum(r["num_tokens"] for r in records)
    return math.exp(-sum(r["loglikelihood"] for r in records) / tokens) if tokens else None
