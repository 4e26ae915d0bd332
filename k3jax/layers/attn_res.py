"""Block Attention Residuals (AttnRes): each sub-layer reads a softmax mixture over depth.

Per token the stream is (bank, p, d): the bank holds the embedding and one sum per closed block of
`attn_res_block_size` layers, p is the running sum of the open block and d the last FFN output not
yet added to p (ARCHITECTURE.md, "AttnRes"). The bank has a fixed number of rows, written in place as blocks
close; a read mixes the rows written so far (`layer_index` is a Python int, so which rows is static).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import param


class AttnResStream(NamedTuple):
    bank: jax.Array  # [B, T, num_blocks, H], activation dtype
    p: jax.Array  # [B, T, H]: running sum of the open block
    d: jax.Array  # [B, T, H]: pending FFN output


class AttnResQuery(nnx.Module):
    """One read point: the score RMSNorm weight and the pseudo-query (`*_res_norm`, `*_res_proj`)."""

    def __init__(self, hidden_size: int, *, dtype, rngs):
        self.norm = param(None, (hidden_size,), ("norm",), dtype, init="ones")
        self.proj = param(rngs, (hidden_size,), ("norm",), dtype)

    def mix(self, bank, num_rows, p, eps: float):
        """MIX over bank rows [0, num_rows) and p; returns the fp32 mixture [B, T, H]."""
        query = self.norm[...].astype(jnp.float32) * self.proj[...].astype(jnp.float32)  # gamma * q
        sources = jnp.concatenate([bank, p[:, :, None]], axis=2).astype(jnp.float32)  # [B, T, N+1, H]
        inv_rms = jax.lax.rsqrt(jnp.mean(sources * sources, axis=-1) + eps)
        logits = inv_rms * jnp.einsum("btnh,h->btn", sources, query)
        row = jnp.arange(bank.shape[2] + 1)
        visible = (row < num_rows) | (row == bank.shape[2])  # written bank rows, and p itself
        logits = jnp.where(visible, logits, -jnp.inf)
        weights = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("btn,btnh->bth", weights, sources)


def start_stream(embeddings, num_blocks: int) -> AttnResStream:
    b, t, h = embeddings.shape
    zeros = jnp.zeros((b, t, h), embeddings.dtype)
    return AttnResStream(jnp.zeros((b, t, num_blocks, h), embeddings.dtype), embeddings, zeros)


def attention_read(stream: AttnResStream, layer_index: int, block_size: int, read: AttnResQuery, eps: float):
    """Step 1 of a layer: fold d into p, write the bank row at block starts, mix for attention.

    Returns (stream, mixture). The read sees the bank rows that existed before this layer's write
    plus p, so a freshly written row is not counted twice.
    """
    p = (stream.p + stream.d).astype(stream.p.dtype)  # bf16 rounding after every add, as vLLM
    rows_before = -(-layer_index // block_size)
    bank = stream.bank.at[:, :, rows_before].set(p) if layer_index % block_size == 0 else stream.bank
    mixture = read.mix(stream.bank, rows_before, p, eps)
    return AttnResStream(bank, p, stream.d), mixture


def ffn_read(stream: AttnResStream, attn_out, layer_index: int, block_size: int, read: AttnResQuery, eps: float):
    """Step 3: add the attention output to the open block (restarting it at block starts), mix for the FFN."""
    is_write = layer_index % block_size == 0
    p = attn_out.astype(stream.p.dtype) if is_write else (stream.p + attn_out).astype(stream.p.dtype)
    rows = -(-layer_index // block_size) + int(is_write)
    mixture = read.mix(stream.bank, rows, p, eps)
    return AttnResStream(stream.bank, p, stream.d), mixture


def final_read(stream: AttnResStream, read: AttnResQuery, eps: float):
    """The read after the last layer, over every bank row and p; the caller applies the final norm."""
    p = (stream.p + stream.d).astype(stream.p.dtype)
    return read.mix(stream.bank, stream.bank.shape[2], p, eps)
