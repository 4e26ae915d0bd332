"""The decoder stack: embedding, the layers, final read, norm and LM head (ARCHITECTURE.md, "Shape
of the decoder"). `K3Transformer` has one entry point per mode (full forward, per-sequence caches,
the engine's pooled step, the speculative verify), each returning one NamedTuple; one layer loop
serves them all.

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
from pallas_kernels.linear import linear


class Batch(NamedTuple):
    """Per-call metadata: which of the T new tokens are real, and where each sequence starts. With
    the serving engine's pooled caches (`PagedState`), also where each sequence's caches live."""

    valid: jax.Array  # [B, T] bool; right padding is False
    lengths: jax.Array  # [B] int32: real new tokens per sequence
    offsets: jax.Array  # [B] int32: tokens already in the cache
    slots: jax.Array | None = None  # [B] int32: KDA state slot of each row (0: the null slot, padding rows)
    page_table: jax.Array | None = None  # [B, max_pages] int32: MLA pages of each row (0: the null page)
    record: bool = False  # a speculative verify: KDA layers record their window instead of writing slots
    sequence_parallel: bool = False  # a fresh prefill with the tokens split over `data` (prefill_sequence_parallel)
    groups: int = 1  # DP attention: rows and pools in this many equal blocks, ids local to the block (PagedState)


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
    # DP attention (serve/runner.py): rows and pool entries split into this many equal blocks, row
    # block g using only pool block g, its slots and pages numbered within the block. A Python int.
    groups: int = 1




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


class ForwardOut(NamedTuple):
    """`K3Transformer.forward`: logits f32 [B, T, V] and, when a `TapSpec` was given, the tapped
    hidden states [B, T, len(taps.layers) * H] (activation dtype; else None)."""

    logits: jax.Array
    taps: jax.Array | None


class ExtendOut(NamedTuple):
    """`K3Transformer.extend`: logits f32 [B, T, V] and the caches holding the new tokens too."""

    logits: jax.Array
    state: DecodeState


class StepOut(NamedTuple):
    """`K3Transformer.step`: logits f32 [B, T, V] (with `last_only`, [B, V]), the pools after the step
    and the taps as in `ForwardOut`."""

    logits: jax.Array
    state: PagedState
    taps: jax.Array | None


class VerifyOut(NamedTuple):
    """`K3Transformer.verify`: logits f32 [B, W, V] of every window position, the pools (MLA rows
    written, KDA slots untouched), the taps as in `ForwardOut`, and the KDA records in layer order
    (None at MLA layers) that `commit_record` folds into the slots once the accepted length is known."""

    logits: jax.Array
    state: PagedState
    taps: jax.Array | None
    records: tuple


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
    """The text decoder as an NNX module, used functionally (caches live outside): one entry point per
    mode, each with one fixed result, all running the same layer loop (`_layers`) and head (`_head`):
    `forward` (no cache), `extend` (per-sequence caches, `DecodeState`), `step` and `verify` (the
    serving engine's pools, `PagedState`; `verify` is the speculative window, KDA layers recording)."""

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

    def forward(self, tokens, lengths=None, *, taps: TapSpec | None = None, embeds=None) -> ForwardOut:
        """The full causal forward without a cache: tokens [B, T] (right-padded), lengths [B] real
        tokens (default T). `embeds`: an input embeddings override, as in `step`."""
        batch = _batch(tokens, lengths)
        h, _, tapped = self._layers(tokens, batch, (None,) * len(self.layers), taps, embeds)
        return ForwardOut(self._head(h), tapped)

    def extend(self, tokens, lengths, state: DecodeState) -> ExtendOut:
        """Prefill or decode over per-sequence caches: tokens [B, T] follow the `state.lengths` tokens
        each sequence already holds (T = 1 for a decode step)."""
        batch = _batch(tokens, lengths, state.lengths)
        h, caches, _ = self._layers(tokens, batch, state.layers, None)
        return ExtendOut(self._head(h), DecodeState(caches, batch.offsets + batch.lengths))

    def prefill_sequence_parallel(self, tokens, lengths, *, last_only: bool = False) -> ExtendOut:
        """A fresh prefill (no cached tokens) whose tokens [B, T] are split over the `data` axis of the
        mesh set around the call, T / data consecutive tokens per shard (k3jax/sequence_parallel.py):
        what crosses the shards (KDA conv windows and states, MLA cache rows) is passed in the layers.
        The same result as `extend` from an empty cache of T tokens (`last_only`: logits of each row's
        last real token only, [B, V], as `step`'s)."""
        batch = _batch(tokens, lengths, sequence_parallel=True)
        # The MLA caches of a fresh prefill are exactly its new rows: the layers make them, so the
        # empty caches passed in hold no tokens.
        empty = init_cache(self.cfg, tokens.shape[0], 0, self.dtype)
        h, caches, _ = self._layers(tokens, batch, empty.layers, None)
        return ExtendOut(self._head(h, lengths if last_only else None), DecodeState(caches, batch.lengths))

    def step(self, tokens, lengths, state: PagedState, *, last_only: bool = False,
             taps: TapSpec | None = None, embeds=None) -> StepOut:
        """A serving step over the engine's pools: prefill chunks and decodes, each row in its slot and
        pages. `last_only`: logits of each row's last real token only, [B, V] (what a step samples from).
        `embeds`: (values [B, T, H], mask [B, T] bool) or None: where the mask is set, the input
        embedding is the value instead of the token's (an image's encoder outputs at its pad positions)."""
        batch = _batch(tokens, lengths, state.offsets, state.slots, state.page_table, groups=state.groups)
        h, caches, tapped = self._layers(tokens, batch, state.layers, taps, embeds)
        return StepOut(self._head(h, batch.lengths if last_only else None), state._replace(layers=caches), tapped)

    def verify(self, tokens, lengths, state: PagedState, *, taps: TapSpec | None = None) -> VerifyOut:
        """A speculative verify over the engine's pools: each row's window (its last token, then the
        drafts) is written to its MLA pages like a step's, but the KDA layers leave their slots as they
        are and record the window instead (`KimiDeltaAttention`), since how much of it stays is known
        only after rejection sampling."""
        batch = _batch(tokens, lengths, state.offsets, state.slots, state.page_table, record=True,
                       groups=state.groups)
        h, caches, tapped = self._layers(tokens, batch, state.layers, taps)
        records = tuple(c.record if isinstance(c, Recorded) else None for c in caches)
        pools = tuple(c.pool if isinstance(c, Recorded) else c for c in caches)
        return VerifyOut(self._head(h), state._replace(layers=pools), tapped, records)

    def _layers(self, tokens, batch: Batch, caches: tuple, taps: TapSpec | None, embeds=None):
        """The embedding (overridden where `embeds` says), every layer and the final read: (h [B, T, H]
        before the norm, the layers' new caches, the tapped hidden states [B, T, len(taps.layers) * H] or None)."""
        cfg = self.cfg
        x = jnp.take(self.embed_tokens[...], tokens, axis=0)
        if embeds is not None:
            values, mask = embeds
            x = jnp.where(mask[..., None], values.astype(x.dtype), x)
        stream = attn_res.start_stream(x, cfg.num_attn_res_blocks) if cfg.attn_res else x
        tapped = {}  # layer index -> its tap [B, T, H]
        new_caches = []
        for i, (layer, layer_cache) in enumerate(zip(self.layers, caches)):
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
        if taps is None:
            return h, tuple(new_caches), None
        if taps.kind == "next_mixture":  # the last layer's tap is the output read
            tapped[cfg.num_hidden_layers - 1] = h
        return h, tuple(new_caches), jnp.concatenate([tapped[i].astype(x.dtype) for i in taps.layers], axis=-1)

    def _head(self, h, last_of=None):
        """Final norm and LM head: f32 logits of every position, or with `last_of` ([B] real token
        counts) of each row's last real token only, [B, V] (the norm and head then run on B rows, not B * T)."""
        cfg = self.cfg
        if last_of is not None:
            h = jnp.take_along_axis(h, jnp.maximum(last_of - 1, 0)[:, None, None], axis=1)[:, 0]
        h = self.norm(h)
        head = self.embed_tokens if cfg.tie_word_embeddings else self.lm_head.kernel  # both [V, H]
        logits = linear(h, head[...])
        if cfg.logit_scale != 1.0:
            logits = logits * cfg.logit_scale
        return logits


def _batch(tokens, lengths, offsets=None, slots=None, page_table=None, *, record: bool = False,
           sequence_parallel: bool = False, groups: int = 1) -> Batch:
    """The `Batch` of tokens [B, T] with `lengths` [B] real tokens each (None: all T) after `offsets`
    cached ones (None: none)."""
    b, t = tokens.shape
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    offsets = jnp.zeros((b,), jnp.int32) if offsets is None else offsets
    return Batch(valid, lengths, offsets, slots, page_table, record, sequence_parallel, groups)


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
