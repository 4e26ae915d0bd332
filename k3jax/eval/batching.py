"""Length-sorted batches padded to a few bucketed shapes, so that a job compiles a handful of
programs and pads little.

Every batch has the same number of rows (padding rows fill the last one); its token length is the
longest row rounded up to a bucket: powers of two and the midpoints between them (16, 24, 32, 48,
...), so padding stays under a third of a row while the number of shapes grows only with log(length).
"""

from __future__ import annotations

import dataclasses

import numpy as np


def length_buckets(max_length: int, smallest: int = 16) -> tuple[int, ...]:
    """16, 24, 32, 48, 64, 96, ... up to `max_length`, which is always the last bucket."""
    sizes, size = [], smallest
    while size < max_length:
        sizes.append(size)
        if size + size // 2 < max_length:
            sizes.append(size + size // 2)
        size *= 2
    return (*sizes, max_length)


def bucket(length: int, sizes: tuple[int, ...]) -> int:
    for size in sizes:
        if size >= length:
            return size
    raise ValueError(f"a row of {length} tokens is longer than the largest bucket {sizes[-1]}")


@dataclasses.dataclass(frozen=True)
class Batch:
    rows: tuple[int, ...]  # indices into the row list; fewer than the batch's rows in the last batch
    length: int  # padded token length (a bucket)


def plan(lengths, rows_per_batch: int, sizes: tuple[int, ...], *, sort: bool = True) -> list[Batch]:
    """Batches of `rows_per_batch` row indices. With `sort`, longest rows first (ties in input order):
    neighbours have similar lengths, and the most memory-hungry batch runs first, so a batch size that
    does not fit fails at once rather than at the end."""
    lengths = np.asarray(lengths, np.int64)
    order = np.lexsort((np.arange(len(lengths)), -lengths)) if sort else np.arange(len(lengths))
    out = []
    for i in range(0, len(order), rows_per_batch):
        rows = tuple(int(r) for r in order[i:i + rows_per_batch])
        out.append(Batch(rows, bucket(int(lengths[list(rows)].max()), sizes)))
    return out


def padding_waste(lengths, batches: list[Batch], rows_per_batch: int) -> float:
    """Fraction of the computed token slots (rows x padded length, padding rows included) that are padding."""
    slots = sum(rows_per_batch * b.length for b in batches)
    return 1.0 - float(np.sum(lengths)) / slots if slots else 0.0


def pack(rows, batch: Batch, rows_per_batch: int, length: int, pad_id: int = 0):
    """The batch's arrays, right-padded to [rows_per_batch, length]: tokens, lengths, first scored
    positions. Padding rows are one token long with nothing scored."""
    tokens = np.full((rows_per_batch, length), pad_id, np.int32)
    lengths = np.ones((rows_per_batch,), np.int32)
    starts = np.ones((rows_per_batch,), np.int32)
    for i, r in enumerate(batch.rows if batch else ()):
        row = rows[r]
        tokens[i, :len(row.tokens)] = row.tokens
        lengths[i], starts[i] = len(row.tokens), row.start
    return tokens, lengths, starts
