"""Sequence-parallel prefill (issue 25): a long prompt's tokens split over the mesh's `data` axis, so
a 1M-token prefill is not one device's job (`K3Model.prefill_sequence_parallel`).

`data` is the axis that holds one sequence's requests today: `model` already splits every token's
heads and widths, so the sequence takes the other axis, and a prompt long enough to need this is the
only request its data groups run. Data shard i holds tokens [i T / n, (i + 1) T / n) of every row.
Everything computed per token (embedding, projections, norms, AttnRes, the MoE, whose expert-parallel
exchange already gathers tokens over `data`, and the head) is partitioned by XLA with no exchange;
what crosses shards is passed inside the layers under shard_map: KDA's conv window and recurrent
state (`k3jax/layers/kda.py`, `pallas_kernels/kda/sequence_parallel.py`), MLA's compressed cache
rows (`k3jax/layers/mla.py`).

Several prompts may share a call (right-padded, each split the same way), but the path is made for
one: the MoE's expert-parallel exchange splits the flattened [B * T] tokens over `data`, so with B > 1
XLA moves every MoE layer's tokens between that split and the split by position.

The cache comes back in `K3Model.prefill`'s layout (rows over `data`, each row's whole sequence in
its data group, `max_len` rows of latent), so `K3Model.decode` continues from it unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.decoder import DecodeState
from k3jax.layers.mla import MLACache
from k3jax.placement import cache_shardings


def padded_length(length: int, shards: int, conv_size: int) -> int:
    """The prompt length rounded up to equal shards (the padding is masked like right padding). A
    shard must hold the conv_size - 1 inputs the next shard's short conv reads."""
    per_shard = -(-length // shards)
    if per_shard < conv_size - 1:
        raise ValueError(f"a {length}-token prompt over {shards} sequence shards leaves {per_shard} tokens a "
                         f"shard; the KDA conv window needs at least {conv_size - 1}")
    return per_shard * shards


@functools.partial(jax.jit, static_argnames=("structure", "mesh", "rows", "max_len", "last_only"))
def prefill(structure, params, tokens, lengths, *, mesh, rows: int, max_len: int, last_only: bool = False):
    """tokens [B, T] (T a multiple of the data size, split over `data`), lengths [B] -> (logits
    float32 [B, T, vocab], or [B, vocab] of each row's last real token with `last_only`, a
    DecodeState of `rows` rows and `max_len` MLA rows per sequence)."""
    logits, state = structure.merge(params).prefill_sequence_parallel(tokens, lengths, last_only=last_only)
    cache = DecodeState(tuple(_decode_layout(c, rows, max_len, mesh) for c in state.layers),
                        _pad_rows(state.lengths, rows))
    return logits, jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))


def _decode_layout(cache, rows: int, max_len: int, mesh):
    """A layer's cache padded to `rows` sequences and, for MLA, cut or padded to `max_len` rows (rows
    past a sequence's length are never read: decoding writes them before it reads them)."""
    if isinstance(cache, MLACache):
        # Each sequence's rows go whole to its data group: gathered here, from their split by position
        # over `data` (left to itself, XLA replicates them while padding them, warning about it).
        latent = jax.lax.with_sharding_constraint(cache.latent, NamedSharding(mesh, PartitionSpec()))[:, :max_len]
        return MLACache(jnp.pad(_pad_rows(latent, rows), ((0, 0), (0, max_len - latent.shape[1]), (0, 0))))
    return type(cache)(*(_pad_rows(x, rows) for x in cache))


def _pad_rows(x, rows: int):
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))
