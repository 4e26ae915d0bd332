"""The K3 DSpark draft model (ARCHITECTURE.md, "DSpark draft") and its two pure,
jittable steps: `inject_context` (the target's tapped hidden states -> draft KV rows in the draft
pages) and `propose` (one forward over the block [bonus, mask x (K-1)], the target's LM head, then
the Markov head left to right).

Draft pages mirror the target's MLA pages: one pool per draft layer (a leading [L] axis), rows of
[normalised latent | rotated key], addressed by the TARGET's page table (the row of position t is
page_table[t // page_size], t % page_size), page 0 the null page that padding writes to. The layer
pools are viewed as one [L * num_pages] pool with layer l's page ids offset by l * num_pages (a free
reshape), so no step copies a layer's pool out of the stack.

The block attends non-causally: every block row sees all positions < p + K, i.e. the same keys, so
the K rows fold into the head axis of the absorbed-form paged decode attention (pages read once;
k3jax.layers.mla's `attend_block`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.dspark.config import DSparkConfig
from k3jax.dspark.markov import markov_sample
from k3jax.layers.common import Linear, RMSNorm, param
from k3jax.layers.ffn import GatedMLP
from k3jax.layers.mla import MLAPages, MultiHeadLatentAttention, page_slots
from pallas_kernels.linear import linear

__all__ = ["DSparkDraft", "SharedHead", "init_draft_pages", "inject_context", "propose", "shared_head"]


class DraftLayer(nnx.Module):
    """Pre-norm MLA (q LoRA, RoPE on the shared key, no output gate) and a dense gated MLP."""

    def __init__(self, cfg: DSparkConfig, *, dtype, rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MultiHeadLatentAttention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(cfg, cfg.intermediate_size, dtype=dtype, rngs=rngs)


class DSparkDraft(nnx.Module):
    """The draft's own parameters (embedding and LM head are the target's: see `shared_head`).

    Attribute paths follow the checkpoint names (k3jax.dspark.loading maps them); kernels are [out, in].
    The confidence head (`confidence_kernel` [in, 1], `confidence_bias` [1]) exists only when the config
    enables it; it is loaded and kept but not used in drafting (adaptive verification is not built).
    """

    def __init__(self, cfg: DSparkConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        h = cfg.hidden_size
        self.cfg = cfg
        self.context_proj = Linear(cfg.context_width, h, ("embed", "embed"), dtype=dtype, rngs=rngs)
        self.context_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DraftLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        # Markov head: w1 an embedding table, w2 a rank-r LM head; vocabulary split like the target's.
        self.markov_w1 = param(rngs, (cfg.vocab_size, cfg.markov_rank), ("vocab", "embed"), dtype, stddev=1.0)
        self.markov_w2 = param(rngs, (cfg.vocab_size, cfg.markov_rank), ("vocab", "embed"), dtype)
        if cfg.enable_confidence_head:
            self.confidence_kernel = param(rngs, (cfg.confidence_width, 1), ("embed", "norm"), jnp.float32)
            self.confidence_bias = param(None, (1,), ("norm",), jnp.float32)

    @property
    def dtype(self):
        return self.final_norm.weight.dtype


class SharedHead(NamedTuple):
    """The target's token embedding and LM head, which the draft uses as its own."""

    embed: jax.Array  # [V, H]
    lm_head: jax.Array | None  # [V, H] kernel; None: tied to embed
    logit_scale: float  # the target's

    def logits(self, h):
        """float32 [..., V] of the draft's final-normed hidden states h [..., H]."""
        return linear(h, self.embed if self.lm_head is None else self.lm_head) * self.logit_scale


def shared_head(model) -> SharedHead:
    """The SharedHead of a k3jax.model.K3Model (its parameters, not copies)."""
    params, cfg = model.params, model.config
    lm_head = None if cfg.tie_word_embeddings else params["lm_head"]["kernel"][...]
    return SharedHead(params["embed_tokens"][...], lm_head, float(cfg.logit_scale))


def init_draft_pages(cfg: DSparkConfig, num_pages: int, page_size: int, dtype, scale: float = 1.0) -> MLAPages:
    """Zeroed draft pages: pages [L, num_pages, page_size, mla_cache_width] in dtype, scale [L] float32."""
    layers = cfg.num_hidden_layers
    return MLAPages(jnp.zeros((layers, num_pages, page_size, cfg.mla_cache_width), dtype),
                    jnp.full((layers,), scale, jnp.float32))


def inject_context(draft: DSparkDraft, pages: MLAPages, taps, valid, offsets, page_table) -> MLAPages:
    """Writes the context KV of the target's tapped hidden states into every draft layer's pages.

    taps [N, T, num_target_layers * target_hidden_size] (target_layer_ids order) hold positions
    offsets[n] + t; valid [N, T] bool (invalid rows go to the null page); page_table [N, max_pages].
    c = context_norm(context_proj(taps)) feeds every layer's kv_a_proj_with_mqa directly.
    """
    num_layers, num_pages, page_size, width = pages.pages.shape
    positions = offsets[:, None] + jnp.arange(taps.shape[1], dtype=jnp.int32)[None, :]
    c = draft.context_norm(draft.context_proj(taps.astype(draft.dtype)))
    page_ids, rows = page_slots(page_table, positions, page_size, valid)
    flat = pages.pages.reshape(num_layers * num_pages, page_size, width)
    for l, layer in enumerate(draft.layers):
        layer_pages = MLAPages(flat, pages.scale[l])
        flat = layer_pages.write(page_ids + l * num_pages, rows, layer.self_attn.cache_rows(c, positions)).pages
    return pages._replace(pages=flat.reshape(pages.pages.shape))


def propose(draft: DSparkDraft, pages: MLAPages, bonus, positions, page_table, head: SharedHead, *,
            temperature, keys, greedy_only: bool, num_tokens: int | None = None):
    """Drafts K = num_tokens (default cfg.block_size) tokens after each row's bonus token.

    bonus [N] int32 sits at absolute position positions[N] = p; the block [bonus, mask x (K-1)] at
    p..p+K-1 writes its KV rows into the draft pages there and attends to every position < p + K.
    temperature [N] float32 (0: greedy row); keys [N] jax PRNG keys (one per row); greedy_only (static)
    skips sampling. Returns (drafts [N, K] int32, draft_logits [N, K, V] float32, pages): draft_logits
    are the Markov-biased logits before temperature; a sampled row drew from softmax(draft_logits / T).
    """
    cfg = draft.cfg
    k = cfg.block_size if num_tokens is None else num_tokens
    num_layers, num_pages, page_size, width = pages.pages.shape
    offsets = jnp.arange(k, dtype=jnp.int32)
    block_positions = positions[:, None] + offsets[None, :]
    tokens = jnp.where(offsets[None, :] == 0, bonus[:, None], cfg.mask_token_id)
    x = jnp.take(head.embed, tokens, axis=0).astype(draft.dtype)
    page_ids, rows = page_slots(page_table, block_positions, page_size, True)
    flat = pages.pages.reshape(num_layers * num_pages, page_size, width)
    kv_length = positions + k
    for l, layer in enumerate(draft.layers):
        h = layer.input_layernorm(x)
        layer_pages = MLAPages(flat, pages.scale[l])
        layer_pages = layer_pages.write(page_ids + l * num_pages, rows, layer.self_attn.cache_rows(h, block_positions))
        x = x + layer.self_attn.attend_block(h, block_positions, layer_pages, page_table + l * num_pages, kv_length)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        flat = layer_pages.pages
    base = head.logits(draft.final_norm(x))
    drafts, draft_logits = markov_sample(base, bonus, draft.markov_w1[...], draft.markov_w2[...], cfg.logit_scale,
                                         temperature, keys, greedy_only=greedy_only)
    return drafts, draft_logits, pages._replace(pages=flat.reshape(pages.pages.shape))
