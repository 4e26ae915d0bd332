"""A long prompt prefilled with its tokens split over the mesh's `data` axis, for the engine (issue 25).

With DP attention each data group serves its own requests, so a long prompt's chunked prefill runs
on its group's devices only, however many groups the mesh has. A fresh prompt of at least
`EngineOptions.sequence_parallel_prefill_tokens` tokens is instead prefilled by every device at once
(`K3Model.prefill_sequence_parallel`, k3jax/sequence_parallel.py), on the engine's thread between
steps (its collectives must not interleave with a step's), and its cache enters the pools the way a
prefill server's handoff does (serve/disagg): the MLA rows and the KDA state and conv window of all
its tokens but the last, written into the request's pages and slot in its group, after which the
engine computes the last token and samples as after any prefill. The other requests wait for it, as
they would for a step of the whole mesh.

Compiles once per power-of-two prompt length (the cache's rows are that bucket too), on first use:
warm-up does not compile these. The prompt's cache passes whole through every device on its way into
the pools (the model's prefill gathers each row's MLA rows into its data group, the handoff's write
places them on every device before the scatter keeps the group's): at K3's size that is 27 GiB of
bf16 MLA rows for a 1M-token prompt beside the weights and pools, so today this suits prompts of up
to a few hundred thousand tokens; scattering the rows straight from their split by position into the
group's pool block would lift that.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from k3jax.layers.kda import KDACache
from k3jax.layers.mla import MLACache, MLAPages
from serve.disagg.handoff import Handoff
from sharding.mesh import data_size


def bucket_length(tokens: int, page_size: int, shards: int, conv_size: int) -> int:
    """The padded length a prompt of `tokens` is prefilled at: a power of two (one compile each), at
    least a KDA conv window per sequence shard, in whole pages."""
    length = max(1 << (tokens - 1).bit_length(), shards * (conv_size - 1))
    return -(-length // page_size) * page_size


def handoff(model, ids: list[int], pools, page_size: int) -> Handoff:
    """The cache of `ids` but its last token, in a `Handoff`'s layout for `pools` (the engine's: its MLA
    pages' dtype and scale), computed with the tokens split over `data`. Device arrays."""
    cached = ids[:-1]
    bucket = bucket_length(len(cached), page_size, data_size(model.mesh), model.config.kda_conv_size)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :len(cached)] = cached
    _, cache = model.prefill_sequence_parallel(tokens, [len(cached)], max_len=bucket, last_only=True)
    mla = [layer for layer in cache.layers if isinstance(layer, MLACache)]
    kda = [layer for layer in cache.layers if isinstance(layer, KDACache)]
    page_pools = [pool for pool in pools if isinstance(pool, MLAPages)]
    rows = jnp.stack([pool.stored(layer.latent[0]) for layer, pool in zip(mla, page_pools, strict=True)])
    pages = rows.reshape(len(mla), bucket // page_size, page_size, rows.shape[-1]).transpose(1, 0, 2, 3)
    conv = jnp.stack([layer.conv[:1] for layer in kda], 1)
    state = jnp.stack([layer.state[:1] for layer in kda], 1)
    return Handoff(len(cached), pages, conv, state)
