"""The rejection sampler of speculative decoding: which drafts of a window the target accepts, and
the token it adds after them.

A row's window holds the target's logits at positions 0..K (position j predicts the token after
the row's last token and drafts[:j]). Position j is sampled exactly as `serve.sampling.sample`
would sample it after the tokens before it: bans for min_tokens counted at num_generated + j,
penalties over the outputs plus drafts[:j], then temperature and the min-p / top-k / top-p filters,
giving the target distribution p_j (greedy rows: its argmax). Draft j is accepted while
- greedy rows: it equals the argmax;
- sampled rows: u_j * q_j(d_j) < p_j(d_j), with q_j the distribution the draft was drawn from
  (softmax(draft_logits_j / T) for probabilistic drafts, a point mass for greedy drafts);
the first rejected position a gets a token from the residual max(p_a - q_a, 0) (renormalised), and a
row whose K drafts all pass gets the bonus token, a plain draw from p_K. Each emitted token is then
distributed exactly as without speculation (Leviathan et al. 2023; Chen et al. 2023).

Randomness: position j uses the key `sampling.row_keys` gives the request at num_generated + j,
the key of that output token without speculation: the plain and residual draws use it as is (so a
row without drafts draws the very token `sample` would), the acceptance test and the draft model
fold in their own stream constants.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from serve import sampling
from serve.sampling import SamplingBatch, SamplingParams

ACCEPT_STREAM = 1  # folded into a position's key for the uniform of its acceptance test
DRAFT_STREAM = 2  # folded into the key of a window's first position for the draft model's draws


class VerifyResult(NamedTuple):
    num_accepted: jax.Array  # int32 [N]: drafts accepted; the row emits num_accepted + 1 tokens
    tokens: jax.Array  # int32 [N, K+1]: the accepted drafts, then the correction or bonus token; -1 after
    logprob: jax.Array  # f32 [N, K+1]: raw logprob of each token (garbage where tokens is -1)
    top_ids: jax.Array  # int32 [N, K+1, num_logprobs]
    top_logprobs: jax.Array  # f32 [N, K+1, num_logprobs]


def window_batch(params: Sequence[SamplingParams], num_rows: int, window: int, *, num_generated: Sequence[int],
                 request_ids: Sequence[int], eos_token_ids: Sequence[int] = (), engine_seed: int = 0,
                 vocab_size: int | None = None) -> SamplingBatch:
    """The SamplingBatch of num_rows windows of `window` positions, flattened row-major: position j
    of request i is row i * window + j, at num_generated[i] + j tokens generated."""
    flat_params = [p for p in params for _ in range(window)]
    return SamplingBatch.from_params(
        flat_params, num_rows * window, num_generated=[g + j for g in num_generated for j in range(window)],
        request_ids=[r for r in request_ids for _ in range(window)], eos_token_ids=eos_token_ids,
        engine_seed=engine_seed, vocab_size=vocab_size)


def draft_keys(batch: SamplingBatch) -> jax.Array:
    """The draft model's key per row of a one-position batch (a window's first position)."""
    return jax.vmap(lambda key: jax.random.fold_in(key, DRAFT_STREAM))(sampling.row_keys(batch))


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def verify(target_logits: jax.Array, drafts: jax.Array, draft_logits: jax.Array | None, num_drafts: jax.Array,
           batch: SamplingBatch, output_counts: jax.Array, prompt_mask: jax.Array, *,
           num_logprobs: int | None = 0) -> VerifyResult:
    """Accepts a prefix of each row's drafts and samples the token after it.

    target_logits [N, K+1, V]; drafts int32 [N, K] (the first num_drafts[n] are real); draft_logits
    float32 [N, K, V] for probabilistic drafts, None for greedy ones; batch from `window_batch`;
    output_counts int32 [N, V] and prompt_mask bool [N, V] (or both None) and num_logprobs (None: no
    logprob fields) as for `sampling.sample`.
    """
    n, window, vocab = target_logits.shape
    k = window - 1
    logits = target_logits.astype(jnp.float32).reshape(n * window, vocab)
    if output_counts is not None:  # else no row uses a penalty
        output_counts = _window_counts(output_counts, drafts, num_drafts)
        prompt_mask = jnp.repeat(prompt_mask, window, axis=0)
    penalised = sampling.penalised_logits(logits, batch, output_counts, prompt_mask).reshape(n, window, vocab)
    greedy = batch.temperature.reshape(n, window)[:, 0] == 0
    has_draft = jnp.arange(k)[None, :] < num_drafts[:, None]
    argmax = sampling.argmax(penalised)

    def greedy_rows():
        num_accepted = _prefix_length((drafts == argmax[:, :k]) & has_draft)
        return num_accepted, _at(argmax, num_accepted)

    def mixed_rows():
        keys = sampling.row_keys(batch).reshape(n, window)
        filtered = sampling.filtered_logits(penalised.reshape(n * window, vocab), batch).reshape(n, window, vocab)
        p = jax.nn.softmax(filtered, axis=-1)
        p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        if draft_logits is None:
            q = None
            q_draft = jnp.ones_like(p_draft)
        else:
            temperature = jnp.where(greedy, 1.0, batch.temperature.reshape(n, window)[:, 0])
            q = jax.nn.softmax(draft_logits.astype(jnp.float32) / temperature[:, None, None], axis=-1)
            q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, ACCEPT_STREAM))))(keys[:, :k])
        passed = jnp.where(greedy[:, None], drafts == argmax[:, :k], u * q_draft < p_draft)
        num_accepted = _prefix_length(passed & has_draft)

        rejected = num_accepted < num_drafts
        last = jnp.minimum(num_accepted, k - 1)  # the rejected draft's index (when there is one)
        plain = _at(filtered, num_accepted)
        if q is None:  # residual of a point mass: p without the rejected draft
            residual = plain.at[jnp.arange(n), _at(drafts, last)].set(-jnp.inf)
        else:
            mass = jnp.maximum(_at(p, num_accepted) - _at(q, last), 0.0)
            # p == q leaves no residual mass, and then the test never rejects: any fallback will do
            residual = jnp.where(jnp.sum(mass, axis=-1, keepdims=True) > 0, jnp.log(mass), plain)
        drawn = sampling.gumbel_argmax(jnp.where(rejected[:, None], residual, plain), _at(keys, num_accepted))
        return num_accepted, jnp.where(greedy, _at(argmax, num_accepted), drawn)

    num_accepted, next_token = jax.lax.cond(jnp.all(greedy), greedy_rows, mixed_rows)
    positions = jnp.arange(window)[None, :]
    padded_drafts = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(positions < num_accepted[:, None], padded_drafts,
                       jnp.where(positions == num_accepted[:, None], next_token[:, None], -1))
    if num_logprobs is None:
        return VerifyResult(num_accepted, tokens, None, None, None)
    logprob, top_ids, top_logprobs = sampling.raw_logprobs(target_logits.astype(jnp.float32),
                                                           jnp.maximum(tokens, 0), num_logprobs)
    return VerifyResult(num_accepted, tokens, logprob, top_ids, top_logprobs)


def _window_counts(output_counts, drafts, num_drafts):
    """int32 [N * (K+1), V]: the output counts each window position is penalised with, i.e. the row's
    counts plus its drafts before that position (drafts past num_drafts never count)."""
    n, k = drafts.shape
    added = jnp.zeros((n, k + 1, output_counts.shape[-1]), output_counts.dtype)
    valid = (jnp.arange(k)[None, :] < num_drafts[:, None]).astype(output_counts.dtype)
    added = added.at[jnp.arange(n)[:, None], jnp.arange(1, k + 1)[None, :], drafts].add(valid)
    return (output_counts[:, None, :] + jnp.cumsum(added, axis=1)).reshape(n * (k + 1), -1)


def _prefix_length(passed):
    """Leading True values per row of bool [N, K]."""
    return jnp.sum(jnp.cumprod(passed.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _at(values, index):
    """values[n, index[n]] for values [N, W, ...]."""
    return values[jnp.arange(values.shape[0]), index]

