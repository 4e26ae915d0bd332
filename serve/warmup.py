"""Compiling every step shape an engine can run before it serves (`Engine.warmup`), so nothing
compiles while serving.

A shape is warmed by running it on padding rows (the pools' real entries stay untouched) with a
request of each sampler variant, or, behind an open port, by lowering and compiling it without
running a step (`Runner.compile`): those compile on a daemon thread while the engine serves. A
speculator's verify, commit and draft programs compile with the decode shapes; the pools' gathers and
scatters (a host KV tier's transfers, a PD handoff's read and write) compile last.
"""

from __future__ import annotations

import threading

from serve import sampling
from serve.dspark import speculation
from serve.scheduler import Request
from serve.step_sampler import picked


def warmup(engine, *, background: bool = False, transfers: bool = False, log=None) -> threading.Thread | None:
    """`Engine.warmup`."""
    transfers = transfers or engine.offload is not None
    shapes = [(rows, 1) for rows in engine.decode_rows]
    shapes += [(rows, tokens) for rows in engine.prefill_rows for tokens in engine.prefill_tokens]
    first = [(engine.decode_rows[0], 1), (engine.prefill_rows[0], engine.prefill_tokens[0])]
    now = first if background else shapes
    if engine.prefix_cache is not None:
        engine.runner.copy_slot(0, 0)
    for done, (num_rows, num_tokens) in enumerate(now, 1):
        if num_tokens == 1 and engine.speculator is not None:
            speculation.warm_verify(engine, num_rows)
        else:
            _run(engine, num_rows, num_tokens)
        if log is not None:
            log(done, len(shapes))
    rest = [shape for shape in shapes if shape not in now]
    if not rest:
        if transfers:
            engine.runner.compile_transfers()
        return None
    thread = threading.Thread(target=_compile_ahead, args=(engine, rest, len(now), len(shapes), transfers, log),
                              name="compile-ahead", daemon=True)
    thread.start()
    return thread


def _run(engine, num_rows: int, num_tokens: int) -> None:
    """Runs the step of [num_rows, num_tokens] on padding rows, and each sampler variant on its logits."""
    logits, taps = engine.runner.run([], num_rows, num_tokens)
    if engine.speculator is not None:
        engine.speculator.observe([], taps)
    for params in sampling.VARIANTS:
        ready = [(0, Request("warmup", [0], params, -1))]
        picked(engine.sampler(ready, num_rows)(logits), ready)


def _compile_ahead(engine, shapes, done: int, total: int, transfers: bool, log) -> None:
    """Compiles the steps of `shapes` and their samplers without running them (the engine may be serving)."""
    samplers = {rows for rows, _ in shapes} - {engine.decode_rows[0], engine.prefill_rows[0]}
    for num_rows, num_tokens in shapes:
        if num_tokens == 1 and engine.speculator is not None:  # its decode steps verify windows
            speculation.compile_verify(engine, num_rows)
        else:
            logits, taps = engine.runner.compile(num_rows, num_tokens)
            if engine.speculator is not None:
                engine.speculator.compile(taps)
            if num_rows in samplers:
                samplers.discard(num_rows)
                for params in sampling.VARIANTS:
                    engine.sampler([(0, Request("warmup", [0], params, -1))], num_rows).compile(logits)
        done += 1
        if log is not None:
            log(done, total)
    if transfers:  # last: the host tier copies only once the prefix cache evicts (an earlier handoff compiles its own)
        engine.runner.compile_transfers()
