"""Where the chunks of packed sequences lie, shared by the chunked XLA path and the Pallas kernels.

Each sequence is cut into chunks of at most `chunk` tokens from its own first token, so no chunk
holds two sequences. With state snapshots every `every` tokens, the cut also restarts at each
multiple of `every` (a sequence becomes pieces of `every` tokens, then the rest), so every snapshot
position ends a chunk and the state after that chunk is the snapshot. Everything here works on a
traced cu_seqlens: the chunk count has a static bound that follows from T, N, chunk and every.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ChunkLayout(NamedTuple):
    """Per chunk ([M], M = the static bound; chunks past the used ones have length 0):"""

    start: jax.Array  # int32: its first token on the packed T axis
    length: jax.Array  # int32: its token count (0 for an unused chunk)
    seq: jax.Array  # int32: the sequence that owns it (clamped to N - 1 for unused chunks)
    first: jax.Array  # bool: the sequence's first chunk
    last: jax.Array  # bool: the sequence's last chunk
    snapshot: jax.Array  # int32: the snapshot row of the state after it, or -1
    # Per sequence ([N]):
    seq_first: jax.Array  # int32: index of its first chunk
    seq_chunks: jax.Array  # int32: its chunk count (0 for an empty sequence)


def piece_length(t: int, every: int | None) -> int:
    """Tokens between forced chunk restarts: `every`, or more than any sequence holds."""
    return every if every else t + 1


def num_chunks_bound(t: int, num_seqs: int, chunk: int, every: int | None) -> int:
    """Most chunks N sequences of T tokens in all can take: each sequence's last partial chunk, and
    one more per piece boundary, are the only chunks with fewer than `chunk` tokens."""
    return max(1, (t + num_seqs * (chunk - 1)) // chunk + (t // every if every else 0))


def snapshot_offsets(cu_seqlens, every: int):
    """[N] int32: the first snapshot row of each sequence (rows follow sequences, then positions)."""
    full = (cu_seqlens[1:] - cu_seqlens[:-1]) // every
    return (jnp.cumsum(full) - full).astype(jnp.int32)


def chunk_layout(cu_seqlens, t: int, chunk: int, every: int | None, num_chunks: int) -> ChunkLayout:
    """The chunks of the packed sequences in cu_seqlens ([N + 1] offsets into T tokens), listed
    sequence by sequence; num_chunks >= num_chunks_bound(...) rows."""
    cu = cu_seqlens.astype(jnp.int32)
    piece = piece_length(t, every)
    per_piece = -(-piece // chunk)  # chunks in a full piece
    lengths = cu[1:] - cu[:-1]
    full = lengths // piece
    seq_chunks = full * per_piece + (lengths % piece + chunk - 1) // chunk
    seq_end = jnp.cumsum(seq_chunks)
    seq_first = seq_end - seq_chunks
    index = jnp.arange(num_chunks, dtype=jnp.int32)
    seq = jnp.searchsorted(seq_end, index, side="right")  # side="right" skips empty sequences
    used = seq < lengths.shape[0]
    seq = jnp.minimum(seq, lengths.shape[0] - 1).astype(jnp.int32)
    local = index - seq_first[seq]
    piece_index, within = local // per_piece, local % per_piece
    offset = piece_index * piece + within * chunk  # first token, counted from the sequence's start
    end = jnp.minimum(piece_index * piece + jnp.minimum((within + 1) * chunk, piece), lengths[seq])
    length = jnp.where(used, end - offset, 0)
    ends_full_piece = used & (piece_index < full[seq]) & (within == per_piece - 1)
    snapshot = -1 if every is None else snapshot_offsets(cu, piece)[seq] + piece_index
    return ChunkLayout(
        start=jnp.where(used, cu[seq] + offset, 0).astype(jnp.int32),
        length=length.astype(jnp.int32),
        seq=seq,
        first=used & (local == 0),
        last=used & (local == seq_chunks[seq] - 1),
        snapshot=jnp.where(ends_full_piece, snapshot, -1).astype(jnp.int32),
        seq_first=seq_first.astype(jnp.int32),
        seq_chunks=seq_chunks.astype(jnp.int32),
    )


def padded_positions(cu_seqlens, t: int, chunk: int, every: int | None, layout: ChunkLayout):
    """[T] int32: each token's row in a layout where chunk m occupies rows [m * chunk, (m + 1) * chunk)."""
    cu = cu_seqlens.astype(jnp.int32)
    piece = piece_length(t, every)
    tokens = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], tokens, side="right")  # side="right" skips empty sequences
    seq = jnp.minimum(seq, cu.shape[0] - 2)
    position = tokens - cu[seq]
    in_piece = position % piece
    chunk_index = layout.seq_first[seq] + position // piece * -(-piece // chunk) + in_piece // chunk
    return (chunk_index * chunk + in_piece % chunk).astype(jnp.int32)
