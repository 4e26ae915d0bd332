"""The DSpark Markov head at sampling time (ARCHITECTURE.md, "DSpark draft"): left to right over the block,
each row's logits biased by the token drawn for the row before (the bonus for row 0):

    logits_j = base_j + logit_scale * markov_w2 @ markov_w1[prev];  draft_j ~ logits_j;  prev = draft_j

A greedy row (temperature 0) takes the argmax; a sampled row a Gumbel-max draw from
softmax(logits_j / T) with its own key folded with j. No top-k/top-p: the rejection sampler's q is
exactly softmax(draft_logits / T).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.sampling_noise import gumbel_noise


@functools.partial(jax.jit, static_argnames="greedy_only")
def markov_sample(base, bonus, markov_w1, markov_w2, logit_scale, temperature, keys, *, greedy_only: bool):
    """base [N, K, V] float32 logits; bonus [N] int32; markov_w1, markov_w2 [V, r]; temperature [N]
    float32; keys [N] PRNG keys. Returns (drafts [N, K] int32, biased logits [N, K, V] float32)."""
    w1, w2 = markov_w1.astype(jnp.float32), markov_w2.astype(jnp.float32)
    sampled_row = temperature > 0
    safe_temperature = jnp.where(sampled_row, temperature, 1.0)[:, None]

    def step(prev, xs):
        base_j, j = xs
        logits = base_j + logit_scale * jnp.dot(w1[prev], w2.T, preferred_element_type=jnp.float32)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if not greedy_only:
            gumbel = jax.vmap(lambda key: gumbel_noise(jax.random.fold_in(key, j), logits.shape[-1]))(keys)
            drawn = jnp.argmax(logits / safe_temperature + gumbel, axis=-1).astype(jnp.int32)
            token = jnp.where(sampled_row, drawn, token)
        return token, (token, logits)

    steps = (jnp.swapaxes(base.astype(jnp.float32), 0, 1), jnp.arange(base.shape[1], dtype=jnp.int32))
    _, (drafts, logits) = jax.lax.scan(step, bonus.astype(jnp.int32), steps)
    return jnp.swapaxes(drafts, 0, 1), jnp.swapaxes(logits, 0, 1)
