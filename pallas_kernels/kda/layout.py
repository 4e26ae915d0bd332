"""Where the chunks of packed sequences lie, shared by the chunked XLA path and the Pallas kernels.

Each sequence is cut into chunks of at most `chunk` tokens from its own first token, so no chunk
holds two sequences. Everything here works on a traced cu_seqlens: the chunk count has a static
bound that follows from T, N and chunk.
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
    # Per sequence ([N]):
    seq_first: jax.Array  # int32: index of its first chunk
    seq_chunks: jax.Array  # int32: its chunk count (0 for an empty sequence)


def num_chunks_bound(t: int, num_seqs: int, chunk: int) -> int:
    """Most chunks N sequences of T tokens in all can take: each sequence's last partial chunk is the
    only one with fewer than `chunk` tokens."""
    return max(1, (t + num_seqs * (chunk - 1)) // chunk)


def chunk_layout(cu_seqlens, chunk: int, num_chunks: int) -> ChunkLayout:
    """The chunks of the packed sequences in cu_seqlens ([N + 1] offsets into T tokens), listed
    sequence by sequence; num_chunks >= num_chunks_bound(...) rows."""
    cu = cu_seqlens.astype(jnp.int32)
    lengths = cu[1:] - cu[:-1]
    seq_chunks = (lengths + chunk - 1) // chunk
    seq_end = jnp.cumsum(seq_chunks)
    seq_first = seq_end - seq_chunks
    index = jnp.arange(num_chunks, dtype=jnp.int32)
    seq = jnp.searchsorted(seq_end, index, side="right")  # side="right" skips empty sequences
    used = seq < lengths.shape[0]
    seq = jnp.minimum(seq, lengths.shape[0] - 1).astype(jnp.int32)
    local = index - seq_first[seq]
    offset = local * chunk  # first token, counted from the sequence's start
    length = jnp.where(used, jnp.minimum(offset + chunk, lengths[seq]) - offset, 0)
    return ChunkLayout(
        start=jnp.where(used, cu[seq] + offset, 0).astype(jnp.int32),
        length=length.astype(jnp.int32),
        seq=seq,
        first=used & (local == 0),
        last=used & (local == seq_chunks[seq] - 1),
        seq_first=seq_first.astype(jnp.int32),
        seq_chunks=seq_chunks.astype(jnp.int32),
    )


def padded_positions(cu_seqlens, t: int, chunk: int, layout: ChunkLayout):
    """[T] int32: each token's row in a layout where chunk m occupies rows [m * chunk, (m + 1) * chunk)."""
    cu = cu_seqlens.astype(jnp.int32)
    tokens = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], tokens, side="right")  # side="right" skips empty sequences
    seq = jnp.minimum(seq, cu.shape[0] - 2)
    position = tokens - cu[seq]
    return ((layout.seq_first[seq] + position // chunk) * chunk + position % chunk).astype(jnp.int32)
