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
the K rows fold into the head axis of the absorbed-form paged decode attention (pages read once).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.dspark_config import DSparkConfig
from k3jax.layers.common import Linear, RMSNorm, param
from k3jax.layers.mla import MLAPages, rope_interleaved
from pallas_kernels import mla as mla_ops
from pallas_kernels.activations import GatedActivation
from serve.dspark.markov import markov_sample

FOLD_ROWS = 128  # query rows (block rows x heads) per paged attention call

__all__ = ["DSparkDraft", "SharedHead", "init_draft_pages", "inject_context", "markov_sample", "propose",
           "shared_head"]


class DraftAttention(nnx.Module):
    """MLA with q LoRA and RoPE on the shared key: no output gate, no q/k norm, no NoPE."""

    def __init__(self, cfg: DSparkConfig, *, dtype, rngs):
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        self.q_a_proj = Linear(h, cfg.q_lora_rank, ("embed", "q_lora"), dtype=dtype, rngs=rngs)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype)
        self.q_b_proj = Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, ("q_lora", "heads"), dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(h, cfg.cache_width, ("embed", "kv_latent"), dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                ("kv_lora", "heads"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(heads * cfg.v_head_dim, h, ("heads", "embed"), dtype=dtype, rngs=rngs)

    def kv_rows(self, x, positions):
        """x [N, T, H] at positions [N, T] -> cache rows [N, T, kv_lora_rank + qk_rope_head_dim]."""
        r = self.cfg.kv_lora_rank
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., :r])
        return jnp.concatenate([latent, rope_interleaved(kv[..., r:], positions, self.cfg.rope_theta)], axis=-1)

    def attend(self, x, positions, pool, scale, page_table, kv_length):
        """Queries of x [N, T, H] over the first kv_length[n] rows of the paged pool (absorbed form)."""
        cfg = self.cfg
        n, t, _ = x.shape
        heads, nope, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).reshape(n, t, heads, cfg.qk_head_dim)
        q_rope = rope_interleaved(q[..., nope:], positions[:, :, None], cfg.rope_theta)
        w = self.kv_b_proj.kernel[...].reshape(r, heads, nope + cfg.v_head_dim)
        w_uk, w_uv = w[..., :nope].astype(x.dtype), w[..., nope:].astype(x.dtype)
        q_latent = jnp.einsum("nthd,chd->nthc", q[..., :nope], w_uk, preferred_element_type=jnp.float32)
        q_full = jnp.concatenate([q_latent.astype(x.dtype), q_rope], axis=-1)
        latent = _block_attention(q_full, pool, scale, page_table, kv_length, cfg.qk_head_dim ** -0.5, r)
        o = jnp.einsum("nthc,chv->nthv", latent, w_uv, preferred_element_type=jnp.float32)
        return self.o_proj(o.astype(x.dtype).reshape(n, t, heads * cfg.v_head_dim))


def _block_attention(q, pool, kv_scale, page_table, kv_length, scale, value_width):
    """q [N, T, heads, C] latent queries that all see the same keys (the first kv_length[n] rows)
    -> [N, T, heads, value_width]. Groups of rows fold into the head axis of one paged decode call,
    at most FOLD_ROWS query rows per call (the kernel pads them to a power of two and holds them at
    once); further groups repeat the row's page table as extra batch rows."""
    n, t, heads, c = q.shape
    per_group = max(1, min(t, FOLD_ROWS // heads))
    groups = -(-t // per_group)
    q = jnp.pad(q, ((0, 0), (0, groups * per_group - t), (0, 0), (0, 0)))
    q = q.reshape(n * groups, per_group * heads, c)
    out = mla_ops.paged_decode_attention(q, pool, jnp.repeat(page_table, groups, axis=0),
                                         jnp.repeat(kv_length, groups), scale=scale, value_width=value_width,
                                         kv_scale=kv_scale)
    return out.reshape(n, groups * per_group, heads, value_width)[:, :t]


class DraftMLP(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, dtype, rngs):
        h, f = cfg.hidden_size, cfg.intermediate_size
        # vLLM's dense MLPs default SiTU's beta to 1.0 when the key is absent.
        self.activation = GatedActivation(cfg.hidden_act, *((cfg.activation_situ_beta or 1.0,
                                                             cfg.activation_situ_linear_beta)
                                                            if cfg.hidden_act == "situ" else (None, None)))
        self.gate_proj = Linear(h, f, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, f, ("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, h, ("mlp", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)).astype(x.dtype))


class DraftLayer(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, dtype, rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = DraftAttention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = DraftMLP(cfg, dtype=dtype, rngs=rngs)


class DSparkDraft(nnx.Module):
    """The draft's own parameters (embedding and LM head are the target's: see `shared_head`).

    Attribute paths follow the checkpoint names (serve.dspark.loading maps them); kernels are [in, out].
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
    lm_head: jax.Array | None  # [H, V] kernel; None: tied to embed
    logit_scale: float  # the target's

    def logits(self, h):
        """float32 [..., V] of the draft's final-normed hidden states h [..., H]."""
        weight = self.embed.T if self.lm_head is None else self.lm_head
        return jnp.dot(h, weight.astype(h.dtype), preferred_element_type=jnp.float32) * self.logit_scale


def shared_head(model) -> SharedHead:
    """The SharedHead of a k3jax.model.K3Model (its parameters, not copies)."""
    params, cfg = model.params, model.config
    lm_head = None if cfg.tie_word_embeddings else params["lm_head"]["kernel"][...]
    return SharedHead(params["embed_tokens"][...], lm_head, float(cfg.logit_scale))


def init_draft_pages(cfg: DSparkConfig, num_pages: int, page_size: int, dtype, scale: float = 1.0) -> MLAPages:
    """Zeroed draft pages: pages [L, num_pages, page_size, cache_width] in dtype, scale [L] float32."""
    layers = cfg.num_hidden_layers
    return MLAPages(jnp.zeros((layers, num_pages, page_size, cfg.cache_width), dtype),
                    jnp.full((layers,), scale, jnp.float32))


def _slots(page_table, positions, page_size, write):
    """(page id, row in page) of positions [N, T]; where `write` is False, the null page."""
    max_pages = page_table.shape[1]
    ids = jnp.take_along_axis(page_table, jnp.minimum(positions // page_size, max_pages - 1), axis=1)
    return jnp.where(write, ids, 0), positions % page_size


def _write(flat, scale, page_ids, rows, values):
    """Stores values [N, T, C] (true values) into the flat pool at (page_ids, rows)."""
    stored = (values.astype(jnp.float32) / scale).astype(flat.dtype)
    return flat.at[page_ids, rows].set(stored)


def inject_context(draft: DSparkDraft, pages: MLAPages, taps, valid, offsets, page_table) -> MLAPages:
    """Writes the context KV of the target's tapped hidden states into every draft layer's pages.

    taps [N, T, num_target_layers * target_hidden_size] (target_layer_ids order) hold positions
    offsets[n] + t; valid [N, T] bool (invalid rows go to the null page); page_table [N, max_pages].
    c = context_norm(context_proj(taps)) feeds every layer's kv_a_proj_with_mqa directly.
    """
    num_layers, num_pages, page_size, width = pages.pages.shape
    positions = offsets[:, None] + jnp.arange(taps.shape[1], dtype=jnp.int32)[None, :]
    c = draft.context_norm(draft.context_proj(taps.astype(draft.dtype)))
    page_ids, rows = _slots(page_table, positions, page_size, valid)
    flat = pages.pages.reshape(num_layers * num_pages, page_size, width)
    for l, layer in enumerate(draft.layers):
        flat = _write(flat, pages.scale[l], page_ids + l * num_pages, rows, layer.self_attn.kv_rows(c, positions))
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
    page_ids, rows = _slots(page_table, block_positions, page_size, True)
    flat = pages.pages.reshape(num_layers * num_pages, page_size, width)
    kv_length = positions + k
    for l, layer in enumerate(draft.layers):
        h = layer.input_layernorm(x)
        flat = _write(flat, pages.scale[l], page_ids + l * num_pages, rows, layer.self_attn.kv_rows(h, block_positions))
        x = x + layer.self_attn.attend(h, block_positions, flat, pages.scale[l], page_table + l * num_pages, kv_length)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    base = head.logits(draft.final_norm(x))
    drafts, draft_logits = markov_sample(base, bonus, draft.markov_w1[...], draft.markov_w2[...], cfg.logit_scale,
                                         temperature, keys, greedy_only=greedy_only)
    return drafts, draft_logits, pages._replace(pages=flat.reshape(pages.pages.shape))
