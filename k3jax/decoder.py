"""The decoder stack: embedding, the layers, final read, norm and LM head. One forward serves
full-sequence, prefill and decode calls (ARCHITECTURE.md, "Shape of the decoder").

Every layer owns its parameters and its caches (no stacked [layers, ...] arrays), and the forward
runs the layers in a Python loop, so each weight and cache is a buffer of its own that a step reads
and writes in place. Scanning a stack of layers instead keeps the trace short, but then every step
slices each layer's weights out of the stack, and XLA materialises those slices: measured on the
compiled decode step, the whole expert pool of every MoE layer and every dense weight were copied
on each step, on XLA:CPU (dynamic- and static-slice fusions) and on an H200 (async dynamic-slice
fusions feeding the Pallas and cuBLAS calls). `tests/k3jax/test_decode_hlo.py` holds the step to
no such copy. The price is compile time that grows with depth (see benchmarks/decode_compile_time.py).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import DENSE, KDA, K3Config
from k3jax.dspark.config import TAP_KINDS
from k3jax.layers import attn_res
from k3jax.layers.common import Linear, RMSNorm, param
from k3jax.layers.ffn import MoE, GatedMLP
from k3jax.layers.kda import KDACache, KimiDeltaAttention, Recorded
from k3jax.layers.mla import MLACache, MLAPages, MultiHeadLatentAttention


class Batch(NamedTuple):
    """Per-call metadata: which of the T new tokens are real, and where each sequence starts. With
    the serving engine's pooled caches (`PagedState`), also where each sequence's caches live."""

    valid: jax.Array  # [B, T] bool; right padding is False
    lengths: jax.Array  # [B] int32: real new tokens per sequence
    offsets: jax.Array  # [B] int32: tokens already in the cache
    slots: jax.Array | None = None  # [B] int32: KDA state slot of each row (0: the null slot, padding rows)
    page_table: jax.Array | None = None  # [B, max_pages] int32: MLA pages of each row (0: the null page)
    record: bool = False  # a speculative verify: KDA layers record their window instead of writing slots


class DecodeState(NamedTuple):
    """Every layer's cache, in layer order, and the sequence lengths."""

    layers: tuple  # per layer: KDACache | MLACache
    lengths: jax.Array  # [B] int32


class PagedState(NamedTuple):
    """The serving engine's cache pools, in layer order, and where this call's rows live: KDA states
    in slots (`KDACache` with a leading slot axis), MLA rows in pages (`MLAPages`)."""

    layers: tuple  # per layer: KDACache (a slot pool) | MLAPages
    offsets: jax.Array  # [B] int32: tokens of each row already in the cache
    slots: jax.Array  # [B] int32
    page_table: jax.Array  # [B, max_pages] int32




@dataclasses.dataclass(frozen=True)
class TapSpec:
    """Which hidden states a forward also returns, per token (DSpark's context features).

    `layers`: target layer indices; the hidden state "after layer i" is, for `residual_sum`, the
    residual stream (for AttnRes: every bank row plus the open block and the pending FFN output,
    i.e. the embedding plus every sub-layer output so far; vLLM's default), and for `next_mixture`
    the pre-norm AttnRes mixture that layer i+1's attention reads (after the last layer: the output
    read; SGLang's choice). Without AttnRes the two are the same residual stream.
    """

    layers: tuple[int, ...]
    kind: str = "residual_sum"

    def __post_init__(self):
        if self.kind not in TAP_KINDS:
            raise ValueError(f"tap kind {self.kind!r} is not one of {TAP_KINDS}")


class Aux(NamedTuple):
    """Extra outputs of a forward: the tapped hidden states [B, T, len(layers) * H] (activation dtype)
    and, in a verify step, the KDA records in layer order (None at MLA layers)."""

    taps: jax.Array | None
    records: tuple | None


def _residual_sum(stream):
    if isinstance(stream, attn_res.AttnResStream):
        return jnp.sum(stream.bank, axis=2, dtype=jnp.float32) + stream.p + stream.d
    return stream


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: K3Config, attn: str, mlp: str, *, dtype, rngs):
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype)
        if cfg.attn_res:
            self.self_attention_res = attn_res.AttnResQuery(h, dtype=dtype, rngs=rngs)
            self.mlp_res = attn_res.AttnResQuery(h, dtype=dtype, rngs=rngs)
        if attn == KDA:
            self.self_attn = KimiDeltaAttention(cfg, dtype=dtype, rngs=rngs)
        else:
            self.self_attn = MultiHeadLatentAttention(cfg, dtype=dtype, rngs=rngs)
        if mlp == DENSE:
            self.mlp = GatedMLP(cfg, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        else:
            self.block_sparse_moe = MoE(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, stream, layer_index: int, cache, batch: Batch):
        """Returns (stream, cache, the pre-norm input of the attention: the AttnRes mixture or the stream)."""
        cfg = self.cfg
        dtype = self.input_layernorm.weight.dtype
        if cfg.attn_res:
            stream, mix = attn_res.attention_read(stream, layer_index, cfg.attn_res_block_size,
                                                  self.self_attention_res, cfg.rms_norm_eps)
            x = self.input_layernorm(mix, dtype)
        else:
            mix = stream
            x = self.input_layernorm(stream)
        a, cache = self.self_attn(x, cache, batch)
        if cfg.attn_res:
            stream, mix = attn_res.ffn_read(stream, a, layer_index, cfg.attn_res_block_size, self.mlp_res,
                                            cfg.rms_norm_eps)
            x = self.post_attention_layernorm(mix, dtype)
        else:
            stream = stream + a
            x = self.post_attention_layernorm(stream)
        f = self.mlp(x) if hasattr(self, "mlp") else self.block_sparse_moe(x)
        stream = stream._replace(d=f) if cfg.attn_res else stream + f
        return stream, cache, mix


class K3Transformer(nnx.Module):
    """The text decoder as an NNX module; use it functionally through `forward` (caches live outside)."""

    def __init__(self, cfg: K3Config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        h = cfg.hidden_size
        self.cfg = cfg
        self.embed_tokens = param(rngs, (cfg.vocab_size, h), ("vocab", "embed"), dtype, stddev=1.0)
        self.layers = nnx.List([DecoderLayer(cfg, attn, mlp, dtype=dtype, rngs=rngs) for attn, mlp in cfg.layer_kinds()])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        if cfg.attn_res:
            self.output_attn_res = attn_res.AttnResQuery(h, dtype=dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(h, cfg.vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        return self.embed_tokens.dtype

    def __call__(self, tokens, lengths=None, cache: DecodeState | PagedState | None = None, *, last_only=False,
                 taps: TapSpec | None = None, record: bool = False):
        """tokens [B, T] (right-padded), lengths [B] real tokens (default T) -> (logits f32 [B, T, V], cache).

        `last_only`: logits of each row's last real token only, [B, V] (what a serving step samples from).
        `taps` and `record` (a speculative verify over pooled caches: KDA slots are not written, see
        `KimiDeltaAttention`) add a third result, `Aux`.
        """
        cfg = self.cfg
        b, t = tokens.shape
        lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
        valid = jnp.arange(t)[None, :] < lengths[:, None]
        if isinstance(cache, PagedState):
            batch = Batch(valid, lengths, cache.offsets, cache.slots, cache.page_table, record)
        elif record:
            raise ValueError("record=True needs the engine's pooled caches (PagedState)")
        else:
            batch = Batch(valid, lengths, cache.lengths if cache is not None else jnp.zeros((b,), jnp.int32))
        x = jnp.take(self.embed_tokens[...], tokens, axis=0)
        stream = attn_res.start_stream(x, cfg.num_attn_res_blocks) if cfg.attn_res else x
        tapped = {}  # layer index -> its tap [B, T, H]
        layer_caches = cache.layers if cache is not None else (None,) * len(self.layers)
        new_caches = []
        for i, (layer, layer_cache) in enumerate(zip(self.layers, layer_caches)):
            stream, layer_cache, mix = layer(stream, i, layer_cache, batch)
            new_caches.append(layer_cache)
            if taps is not None and taps.kind == "residual_sum":
                tapped[i] = _residual_sum(stream)
            elif taps is not None:  # this layer's attention input is the previous layer's tap
                tapped[i - 1] = mix
        if cfg.attn_res:
            h = attn_res.final_read(stream, self.output_attn_res, cfg.rms_norm_eps).astype(x.dtype)
        else:
            h = stream
        if taps is not None and taps.kind == "next_mixture":  # the last layer's tap is the output read
            tapped[cfg.num_hidden_layers - 1] = h
        if last_only:
            h = jnp.take_along_axis(h, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
        h = self.norm(h)
        if cfg.tie_word_embeddings:
            logits = jnp.dot(h, self.embed_tokens[...].T, preferred_element_type=jnp.float32)
        else:
            logits = self.lm_head(h, jnp.float32)
        if cfg.logit_scale != 1.0:
            logits = logits * cfg.logit_scale
        aux = None
        if taps is not None or record:
            records = None
            if record:  # split the KDA records from the pools
                records = tuple(c.record if isinstance(c, Recorded) else None for c in new_caches)
                new_caches = [c.pool if isinstance(c, Recorded) else c for c in new_caches]
            tap_rows = None
            if taps is not None:  # [B, T, taps * H], in the order of taps.layers
                tap_rows = jnp.concatenate([tapped[i].astype(x.dtype) for i in taps.layers], axis=-1)
            aux = Aux(tap_rows, records)
        if isinstance(cache, PagedState):
            out = logits, cache._replace(layers=tuple(new_caches))
        else:
            out = logits, DecodeState(tuple(new_caches), batch.offsets + lengths) if cache is not None else None
        return out if aux is None else (*out, aux)


def init_cache(cfg: K3Config, batch: int, max_len: int, dtype) -> DecodeState:
    """Empty caches for `batch` sequences of at most `max_len` tokens."""
    layers = tuple(KDACache.zeros(cfg, batch, dtype) if attn == KDA else MLACache.zeros(cfg, batch, max_len, dtype)
                   for attn, _ in cfg.layer_kinds())
    return DecodeState(layers, jnp.zeros((batch,), jnp.int32))


def init_pools(cfg: K3Config, *, num_slots: int, num_pages: int, page_size: int, dtype, kv_cache_dtype=None) -> tuple:
    """Empty cache pools for `PagedState.layers`: `num_slots` KDA state slots and `num_pages` MLA pages
    of `page_size` tokens per layer (slot 0 and page 0 are the null slot and page)."""
    return tuple(KDACache.zeros(cfg, num_slots, dtype) if attn == KDA
                 else MLAPages.zeros(cfg, num_pages, page_size, kv_cache_dtype or dtype)
                 for attn, _ in cfg.layer_kinds())
