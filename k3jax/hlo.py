"""Reading compiled programs: which buffers a step materialises outside fused computations.

A decode step should read each weight in place. A weight that is sliced, gathered, copied or
converted into a buffer of its own before use costs a second pass over memory; such buffers show
up in the optimised HLO text (`jax.jit(f).lower(...).compile().as_text()`) as instructions of the
entry computation, of loop bodies or of branches whose results are large. This module lists them,
so that tests and the GPU check can hold a step to "no buffer larger than one expert's weight".
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64,
         "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "f4e2m1fn": 4, "f8e8m0fnu": 8}
# Instructions whose result is no new buffer: views, tuples, control flow (their bodies are read
# on their own) and parameters.
# An async op's start holds its operands; its done holds the result, counted there.
_NO_BUFFER = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
              "after-all", "partition-id", "replica-id", "opt-barrier", "fusion-start", "async-start",
              "copy-start", "all-gather-start", "all-reduce-start", "collective-permute-start"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([\d,]*)\]")
_CONTROL = re.compile(r"\b(?:body|condition|true_computation|false_computation|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


class Buffer(NamedTuple):
    bytes: int
    opcode: str
    name: str
    shape: str
    computation: str


def materialised_buffers(hlo_text: str) -> list[Buffer]:
    """Buffers made by instructions of the entry computation and of every computation it runs as
    control flow (while bodies and conditions, branches, calls), largest first. In-place updates
    (a dynamic-update-slice or scatter, or a fusion whose root is one: the caches a step writes) are
    left out: they write into the buffer they were given, and where XLA cannot let them it inserts
    an explicit `copy`, which is counted."""
    computations, order, entry = {}, [], None
    current = None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            current = head.group(2)
            computations[current] = []
            order.append(current)
            if head.group(1):
                entry = current
            continue
        if current is not None and line.strip() and line.strip() != "}":
            computations[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    in_place = {name for name, lines in computations.items() if _root_opcode(lines) in _IN_PLACE}
    control, pending = set(), [entry]
    while pending:  # the entry and everything it runs as control flow
        name = pending.pop()
        if name in control or name not in computations:
            continue
        control.add(name)
        for line in computations[name]:
            match = _INSTRUCTION.match(line)
            if match and match.group(3) in ("while", "conditional", "call"):
                pending += _CONTROL.findall(line)
                for branches in _BRANCHES.findall(line):
                    pending += [b.strip().lstrip("%") for b in branches.split(",")]
    buffers = []
    for name in control:
        for line in computations[name]:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            result, shape, opcode, rest = match.groups()
            if opcode in _NO_BUFFER or opcode in _IN_PLACE:
                continue
            if opcode == "fusion" and any(callee in in_place for callee in re.findall(r"calls=%?([\w.\-]+)", rest)):
                continue
            size = max((_bytes(dtype, dims) for dtype, dims in _ARRAY.findall(shape)), default=0)
            buffers.append(Buffer(size, opcode, result, shape.split("{")[0], name))
    return sorted(buffers, reverse=True)


def _root_opcode(lines: list[str]) -> str | None:
    for line in lines:
        if line.lstrip().startswith("ROOT"):
            match = _INSTRUCTION.match(line)
            return match.group(3) if match else None
    return None


def _bytes(dtype: str, dims: str) -> int:
    count = math.prod(int(d) for d in dims.split(",") if d)
    return count * _BITS.get(dtype, 32) // 8
