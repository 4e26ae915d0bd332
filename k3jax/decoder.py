"""The decoder stack: embedding, layers grouped by their repeating pattern and scanned, final read,
norm and LM head. One forward serves full-sequence, prefill and decode calls (spec section 2).

Layers are grouped into segments: a pattern of (attention, mlp) kinds repeated `repeats` times, with
the parameters of each pattern position stacked on a leading axis and run under `lax.scan`, so
compile time follows the number of distinct patterns, not the depth (93 layers for K3).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import DENSE, KDA, K3Config
from k3jax.layers import attn_res
from k3jax.layers.common import Linear, RMSNorm, param
from k3jax.layers.ffn import MoE, GatedMLP
from k3jax.layers.kda import KDACache, KimiDeltaAttention, Recorded
from k3jax.layers.mla import MLACache, MLAPages, MultiHeadLatentAttention

MAX_PATTERN = 8  # the longest repeating unit searched for


@dataclasses.dataclass(frozen=True)
class Segment:
    start: int  # first layer index
    kinds: tuple[tuple[str, str], ...]  # (attention, mlp) kind of each pattern position
    repeats: int

    def layer_index(self, position: int, repeat: int) -> int:
        return self.start + repeat * len(self.kinds) + position


def plan_segments(cfg: K3Config) -> tuple[Segment, ...]:
    """Greedy cover of the layer kinds by repeated patterns (longest coverage first, then shortest pattern).

    K3's 93 layers become [dense KDA] + 22 x [KDA, KDA, MLA, KDA] + 2 x [KDA] + 2 x [MLA].
    """
    kinds = cfg.layer_kinds()
    segments, i = [], 0
    while i < len(kinds):
        best = (1, 1)  # (period, repeats)
        for period in range(1, MAX_PATTERN + 1):
            unit = kinds[i:i + period]
            if len(unit) < period:
                break
            repeats = 1
            while kinds[i + repeats * period:i + (repeats + 1) * period] == unit:
                repeats += 1
            if repeats > 1 and period * repeats > best[0] * best[1]:
                best = (period, repeats)
        period, repeats = best
        segments.append(Segment(i, kinds[i:i + period], repeats))
        i += period * repeats
    return _merge_singletons(segments)


def _merge_singletons(segments: list[Segment]) -> tuple[Segment, ...]:
    """Adjacent unrepeated layers become one unrepeated segment (one trace either way, fewer scans)."""
    merged: list[Segment] = []
    for seg in segments:
        if merged and seg.repeats == 1 and merged[-1].repeats == 1:
            prev = merged.pop()
            seg = Segment(prev.start, prev.kinds + seg.kinds, 1)
        merged.append(seg)
    return tuple(merged)


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
    """Caches for every layer, grouped like the segments (stacked [repeats, ...]), and sequence lengths."""

    layers: tuple  # per segment: tuple over pattern positions of KDACache | MLACache
    lengths: jax.Array  # [B] int32


class PagedState(NamedTuple):
    """The serving engine's cache pools, grouped like the segments, and where this call's rows live:
    KDA states in slots (`KDACache` with a leading slot axis), MLA rows in pages (`MLAPages`)."""

    layers: tuple  # per segment: tuple over pattern positions of KDACache (pools) | MLAPages
    offsets: jax.Array  # [B] int32: tokens of each row already in the cache
    slots: jax.Array  # [B] int32
    page_table: jax.Array  # [B, max_pages] int32


TAP_KINDS = ("residual_sum", "next_mixture")


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
    and, in a verify step, the KDA records grouped like the segments (None at MLA positions)."""

    taps: jax.Array | None
    records: tuple | None


def _record_tap(buffer, layers, layer_index, value):
    """Stores value [B, T, H] as the tap of `layer_index` in buffer [len(layers) + 1, B, T, H]; a layer
    that is not tapped writes the last (scratch) row, so the update is one in-place slice write."""
    layers = jnp.asarray(layers, jnp.int32)
    hits = layers == layer_index
    row = jnp.where(jnp.any(hits), jnp.argmax(hits), layers.shape[0])
    return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), row, axis=0)


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

    def __call__(self, stream, layer_index, cache, batch: Batch):
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


class SegmentLayers(nnx.Module):
    """The layers of one segment: one module per pattern position, parameters stacked over repeats."""

    def __init__(self, cfg: K3Config, segment: Segment, *, dtype, rngs):
        self.layers = nnx.List([_stacked(cfg, attn, mlp, segment.repeats, dtype, rngs) for attn, mlp in segment.kinds])


def _stacked(cfg, attn, mlp, repeats, dtype, rngs):
    copies = [DecoderLayer(cfg, attn, mlp, dtype=dtype, rngs=rngs) for _ in range(repeats)]
    graphdef, first = nnx.split(copies[0])
    states = [first] + [nnx.split(m)[1] for m in copies[1:]]

    def stack(*variables):
        v = variables[0]
        return v.replace(jnp.stack([u[...] for u in variables]), logical_axes=("layers",) + v.logical_axes)

    stacked = jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, stacked)


class K3Transformer(nnx.Module):
    """The text decoder as an NNX module; use it functionally through `forward` (caches live outside)."""

    def __init__(self, cfg: K3Config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        h = cfg.hidden_size
        self.cfg = cfg
        self.plan = plan_segments(cfg)
        self.embed_tokens = param(rngs, (cfg.vocab_size, h), ("vocab", "embed"), dtype, stddev=1.0)
        self.segments = nnx.List([SegmentLayers(cfg, seg, dtype=dtype, rngs=rngs) for seg in self.plan])
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
        tapped = None if taps is None else jnp.zeros((len(taps.layers) + 1, b, t, x.shape[-1]), x.dtype)
        new_layers = []
        for seg, layers, seg_cache in zip(self.plan, self.segments, cache.layers if cache else [None] * len(self.plan)):
            (stream, tapped), seg_cache = _run_segment(seg, layers, (stream, tapped), seg_cache, batch, taps)
            new_layers.append(seg_cache)
        if cfg.attn_res:
            h = attn_res.final_read(stream, self.output_attn_res, cfg.rms_norm_eps).astype(x.dtype)
        else:
            h = stream
        if taps is not None and taps.kind == "next_mixture":  # the last layer's tap is the output read
            tapped = _record_tap(tapped, taps.layers, cfg.num_hidden_layers - 1, h)
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
                split = lambda c, i: (c[i] if isinstance(c, Recorded) else (c, None)[i])  # noqa: E731
                records = tuple(tuple(split(c, 1) for c in seg) for seg in new_layers)
                new_layers = [tuple(split(c, 0) for c in seg) for seg in new_layers]
            tap_rows = None
            if taps is not None:  # [taps, B, T, H] -> [B, T, taps * H], in the order of taps.layers
                tap_rows = jnp.moveaxis(tapped[:-1], 0, 2).reshape(b, t, -1)
            aux = Aux(tap_rows, records)
        if isinstance(cache, PagedState):
            out = logits, cache._replace(layers=tuple(new_layers))
        else:
            out = logits, DecodeState(tuple(new_layers), batch.offsets + lengths) if cache is not None else None
        return out if aux is None else (*out, aux)


def _run_segment(seg: Segment, layers: SegmentLayers, carry, seg_cache, batch: Batch, taps: TapSpec | None):
    """carry: (stream, tap buffer or None)."""
    graphdef, state = nnx.split(layers.layers)
    period = len(seg.kinds)
    first_index = seg.start + period * jnp.arange(seg.repeats, dtype=jnp.int32)

    def body(carry, xs):
        stream, tapped = carry
        state_r, cache_r, base = xs
        stacked = nnx.merge(graphdef, state_r)
        caches = []
        for j, layer in enumerate(stacked):
            stream, c, mix = layer(stream, base + j, cache_r[j] if cache_r is not None else None, batch)
            if taps is not None and taps.kind == "residual_sum":
                tapped = _record_tap(tapped, taps.layers, base + j, _residual_sum(stream))
            elif taps is not None:  # this layer's attention input is the previous layer's tap
                tapped = _record_tap(tapped, taps.layers, base + j - 1, mix)
            caches.append(c)
        return (stream, tapped), tuple(caches) if cache_r is not None else None

    if seg.repeats == 1:  # no scan for a single repeat: slice the stacked axis away
        take = lambda a: a[0]  # noqa: E731
        carry, out = body(carry, jax.tree.map(take, (state, seg_cache, first_index)))
        return carry, jax.tree.map(lambda a: a[None], out)
    return jax.lax.scan(body, carry, (state, seg_cache, first_index))


def init_cache(cfg: K3Config, batch: int, max_len: int, dtype) -> DecodeState:
    """Empty caches for `batch` sequences of at most `max_len` tokens."""
    layers = []
    for seg in plan_segments(cfg):
        caches = []
        for attn, _ in seg.kinds:
            one = KDACache.zeros(cfg, batch, dtype) if attn == KDA else MLACache.zeros(cfg, batch, max_len, dtype)
            caches.append(jax.tree.map(lambda a: jnp.broadcast_to(a, (seg.repeats, *a.shape)), one))
        layers.append(tuple(caches))
    return DecodeState(tuple(layers), jnp.zeros((batch,), jnp.int32))


def init_pools(cfg: K3Config, *, num_slots: int, num_pages: int, page_size: int, dtype, kv_cache_dtype=None) -> tuple:
    """Empty cache pools for `PagedState.layers`: `num_slots` KDA state slots and `num_pages` MLA pages
    of `page_size` tokens per layer (slot 0 and page 0 are the null slot and page)."""
    layers = []
    for seg in plan_segments(cfg):
        caches = []
        for attn, _ in seg.kinds:
            one = (KDACache.zeros(cfg, num_slots, dtype) if attn == KDA
                   else MLAPages.zeros(cfg, num_pages, page_size, kv_cache_dtype or dtype))
            caches.append(jax.tree.map(lambda a: jnp.broadcast_to(a, (seg.repeats, *a.shape)), one))
        layers.append(tuple(caches))
    return tuple(layers)
