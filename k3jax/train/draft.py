"""The DSpark draft stage: self-distillation of the k3-tiny-dspark draft from the trained k3-tiny.

The data is what the draft meets in serving. Training conversations' first turns (served prompts)
are continued greedily by the target (its cached decode); the target's full forward over
prompt + continuation gives the tapped hidden states the draft config names (`TapSpec` of its
`target_layer_ids` and `target_hidden_tap`, as the engine returns them to the speculator). An
anchor p is a generated position (the bonus token at p, context the taps of positions < p, as after
`observe`); block row j learns the token at p + 1 + j, which in a greedy continuation is the
target's own greedy token at that offset (`distillation_labels`). The block's forward computes what
`k3jax.dspark.model.propose` computes over the draft pages (`block_logits`); the Markov
head is teacher-forced with the previous label (the bonus for row 0), as greedy drafting feeds it
the previous draft. Deterministic given the seed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k3jax.decoder import TapSpec
from k3jax.dspark.config import DSparkConfig
from k3jax.dspark.model import DSparkDraft, SharedHead
from k3jax.model import K3Model
from k3jax.train.corpus import Conversation
from serve.chat.tokenizer import Tokenizer

@dataclasses.dataclass(frozen=True)
class DraftOptions:
    steps: int = 200
    batch: int = 8  # sequences per step
    anchors: int = 16  # blocks per sequence per step
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.01
    prompts: int = 64  # training conversations whose greedy continuation is distilled
    new_tokens: int = 96  # greedy tokens the target adds to each prompt
    seed: int = 0


class Distillation:
    """Greedy continuations as right-padded rows: tokens int32 [N, T], lengths [N], starts [N] (the
    prompt's length: the first generated position) and the target's taps float32 [N, T, F]."""

    def __init__(self, tokens: np.ndarray, lengths: np.ndarray, starts: np.ndarray, taps: np.ndarray):
        self.tokens, self.lengths, self.starts, self.taps = tokens, lengths, starts, taps


def continuations(target: K3Model, prompts: list[list[int]], new_tokens: int, batch: int = 16) -> list[list[int]]:
    """Each prompt followed by the target's next `new_tokens` greedy tokens (its cached prefill and
    decode: the argmax of the logits serving's greedy sampler reads)."""
    out = []
    for i in range(0, len(prompts), batch):
        rows = prompts[i:i + batch] + [[0]] * (batch - len(prompts[i:i + batch]))  # one compiled shape
        lengths = np.array([len(r) for r in rows], np.int32)
        tokens = np.zeros((batch, max(map(len, prompts))), np.int32)
        for r, row in enumerate(rows):
            tokens[r, :len(row)] = row
        logits, cache = target.prefill(tokens, lengths, max_len=tokens.shape[1] + new_tokens)
        next_tokens = np.argmax(np.asarray(logits)[np.arange(batch), lengths - 1], -1).astype(np.int32)
        generated = [next_tokens]
        for _ in range(new_tokens - 1):
            logits, cache = target.decode(next_tokens, cache)
            next_tokens = np.argmax(np.asarray(logits), -1).astype(np.int32)
            generated.append(next_tokens)
        generated = np.stack(generated, 1)
        out += [list(p) + generated[r].tolist() for r, p in enumerate(prompts[i:i + batch])]
    return out


def distillation_data(target: K3Model, cfg: DSparkConfig, tokenizer: Tokenizer, conversations: list[Conversation],
                      new_tokens: int) -> Distillation:
    """The prompts of `conversations`, their greedy continuations and the target's taps over them."""
    prompts = [c.prompt(tokenizer) for c in conversations]
    rows = continuations(target, prompts, new_tokens)
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    lengths = np.array([len(r) for r in rows], np.int32)
    taps = target_taps(target, cfg, tokens, lengths)
    return Distillation(tokens, lengths, np.array([len(p) for p in prompts], np.int32), taps)


def target_taps(target: K3Model, cfg: DSparkConfig, tokens: np.ndarray, lengths: np.ndarray,
                batch: int = 8) -> np.ndarray:
    """The target's tapped hidden states [N, T, F] over right-padded rows (its full forward)."""
    spec = TapSpec(tuple(cfg.target_layer_ids), cfg.target_hidden_tap)
    forward = jax.jit(lambda params, t, n: nnx.merge(target.graphdef, params).forward(t, n, taps=spec).taps)
    out = []
    for i in range(0, len(tokens), batch):
        rows, n = tokens[i:i + batch], lengths[i:i + batch]
        pad = batch - len(rows)  # one compiled shape
        taps = forward(target.params, np.pad(rows, ((0, pad), (0, 0))), np.pad(n, (0, pad), constant_values=1))
        out.append(np.asarray(taps[:len(rows)], np.float32))
    return np.concatenate(out)


def distillation_labels(tokens, lengths, anchors, block_size: int):
    """Row j of the block at anchor p learns the token at p + 1 + j: (labels [B, A, K], weights
    [B, A, K], 0 past the row's end). tokens [B, T] (a greedy continuation), anchors [B, A]."""
    at = anchors[..., None] + 1 + jnp.arange(block_size)
    labels = jnp.take_along_axis(tokens[:, None, :], jnp.minimum(at, tokens.shape[1] - 1), axis=2)
    return labels, (at < lengths[:, None, None]).astype(jnp.float32)


def block_logits(draft: DSparkDraft, head: SharedHead, tokens, taps, anchors):
    """The draft's base logits float32 [B, A, K, V] (before the Markov head) of the block anchored at
    each anchors[b, a] = p: context the taps of positions < p, the block [tokens[b, p], mask x (K-1)]
    at p..p+K-1, every block row attending to the context and the whole block, as `propose` computes
    it through the draft pages. Dense here (the paged kernel's loop has no gradient): each anchor's
    rows see the shared context rows masked to positions < p, then the block's own rows."""
    cfg = draft.cfg
    k, heads, width = cfg.block_size, cfg.num_attention_heads, cfg.kv_lora_rank
    b, t = tokens.shape
    a = anchors.shape[1]
    block_positions = (anchors[..., None] + jnp.arange(k, dtype=jnp.int32)).reshape(b, a * k)
    bonus = jnp.take_along_axis(tokens, anchors, axis=1)
    x = jnp.take(head.embed, jnp.where(jnp.arange(k) == 0, bonus[..., None], cfg.mask_token_id), axis=0)
    x = x.reshape(b, a * k, -1).astype(draft.dtype)
    context = draft.context_norm(draft.context_proj(taps.astype(draft.dtype)))
    context_positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seen = (jnp.arange(t)[None, None, :] < anchors[..., None])[:, :, None, None, :]  # [B, A, 1, 1, T]
    for layer in draft.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        context_rows = attn.cache_rows(context, context_positions)  # [B, T, C]
        block_rows = attn.cache_rows(h, block_positions).reshape(b, a, k, -1)
        q_nope, q_rope = attn.queries(h, block_positions)
        w = attn.kv_b_proj.kernel[...].reshape(heads, cfg.qk_nope_head_dim + cfg.v_head_dim, width)
        q = jnp.concatenate([jnp.einsum("hnc,bthn->bthc", w[:, :cfg.qk_nope_head_dim], q_nope), q_rope], -1)
        q = q.reshape(b, a, k, heads, -1) * cfg.qk_head_dim ** -0.5
        scores = jnp.concatenate([
            jnp.where(seen, jnp.einsum("bakhc,btc->bakht", q, context_rows), -jnp.inf),
            jnp.einsum("bakhc,bajc->bakhj", q, block_rows)], axis=-1)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
        latent = (jnp.einsum("bakht,btc->bakhc", probs[..., :t], context_rows[..., :width])
                  + jnp.einsum("bakhj,bajc->bakhc", probs[..., t:], block_rows[..., :width]))
        o = jnp.einsum("bakhc,hvc->bakhv", latent, w[:, cfg.qk_nope_head_dim:])
        x = x + attn.o_proj(o.reshape(b, a * k, heads * cfg.v_head_dim).astype(x.dtype))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return head.logits(draft.final_norm(x)).reshape(b, a, k, -1)


def markov_logits(draft: DSparkDraft, base, previous):
    """base [..., K, V] biased by the Markov head from each row's previous token previous [..., K]
    (markov_sample's bias, given the previous tokens instead of drawing them)."""
    w1, w2 = draft.markov_w1[...].astype(jnp.float32), draft.markov_w2[...].astype(jnp.float32)
    return base + draft.cfg.logit_scale * jnp.dot(w1[previous], w2.T, preferred_element_type=jnp.float32)


def distillation_loss(draft: DSparkDraft, head: SharedHead, tokens, lengths, taps, anchors):
    """Mean cross-entropy of every valid block row against its label (`distillation_labels`), the
    Markov head fed the previous label; and the per-offset accuracy of the argmax, float32 [K]."""
    labels, weights = distillation_labels(tokens, lengths, anchors, draft.cfg.block_size)
    bonus = jnp.take_along_axis(tokens, anchors, axis=1)
    previous = jnp.concatenate([bonus[..., None], labels[..., :-1]], axis=-1)
    logits = markov_logits(draft, block_logits(draft, head, tokens, taps, anchors), previous)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]
    hits = (jnp.argmax(logits, -1) == labels) * weights
    return jnp.sum(nll * weights) / jnp.sum(weights), hits.sum((0, 1)) / jnp.maximum(weights.sum((0, 1)), 1)


def sample_anchors(rng: np.random.Generator, data: Distillation, batch: int, anchors: int):
    """`batch` rows and `anchors` generated positions in each (with replacement), whose label at
    offset 0 exists: starts[r] <= p <= lengths[r] - 2."""
    picked = rng.integers(0, len(data.tokens), batch)
    low, high = data.starts[picked], data.lengths[picked] - 1
    positions = low[:, None] + (rng.random((batch, anchors)) * (high - low)[:, None]).astype(np.int32)
    return (data.tokens[picked], data.lengths[picked], data.taps[picked], positions.astype(np.int32))


def train(cfg: DSparkConfig, head: SharedHead, data: Distillation, options: DraftOptions, log=print):
    """Trains a fresh fp32 draft on `data`. Returns (draft module, history: per-step losses and the
    last step's per-offset accuracy)."""
    draft = DSparkDraft(cfg, dtype=jnp.float32, rngs=nnx.Rngs(options.seed))
    graphdef, params = nnx.split(draft)
    warmup = min(options.warmup, options.steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, options.lr, warmup, options.steps, options.lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=options.weight_decay))
    state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, tokens, lengths, taps, anchors):
        def loss(p):
            return distillation_loss(nnx.merge(graphdef, p), head, tokens, lengths, taps, anchors)

        (value, accuracy), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value, accuracy

    rng = np.random.default_rng(options.seed)
    losses, accuracy = [], None
    for i in range(options.steps):
        params, state, value, accuracy = step(params, state, *sample_anchors(rng, data, options.batch, options.anchors))
        losses.append(float(value))
        if log and (i % 25 == 0 or i == options.steps - 1):
            log(f"draft step {i}: loss {losses[-1]:.3f}, accuracy by offset {np.round(np.asarray(accuracy), 2)}")
    return nnx.merge(graphdef, params), {"loss": losses, "last_accuracy": np.asarray(accuracy).tolist()}
