"""The rejection sampler against independent references: the one-token sampler for windows without
drafts, a NumPy prefix rule for greedy rows, a token-by-token sampler for penalties and bans inside a
window, and chi-square tests that the emitted tokens follow the target distribution whatever q is."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from serve import sampling
from serve.dspark import rejection
from serve.sampling import SamplingBatch, SamplingParams

EOS = 3


def verify(logits, drafts, num_drafts, params, *, draft_logits=None, num_generated=None, output_counts=None,
           prompt_mask=None, num_logprobs=0):
    n, window, vocab = logits.shape
    num_generated = [0] * n if num_generated is None else num_generated
    batch = rejection.window_batch(params, n, window, num_generated=num_generated, request_ids=range(n),
                                   eos_token_ids=[EOS], engine_seed=5)
    if output_counts is not None:  # else no penalties: the engine's None path
        output_counts, prompt_mask = jnp.asarray(output_counts), jnp.asarray(prompt_mask)
    result = rejection.verify(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32),
                              None if draft_logits is None else jnp.asarray(draft_logits),
                              jnp.asarray(num_drafts, jnp.int32), batch, output_counts, prompt_mask,
                              num_logprobs=num_logprobs)
    return np.asarray(result.num_accepted), np.asarray(result.tokens), result


MIXED = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=11),
         SamplingParams(temperature=1.3, top_k=4), SamplingParams(temperature=0.9, top_p=0.6, min_p=0.05),
         SamplingParams(temperature=1.0)]


def test_a_window_without_drafts_draws_what_sample_draws():
    """verify without penalty inputs (None) against sample with all-zero ones."""
    rng = np.random.default_rng(0)
    params = MIXED * 3
    n, vocab = len(params), 37
    logits = rng.normal(size=(n, 4, vocab)).astype(np.float32) * 3
    generated = rng.integers(0, 20, n).tolist()
    num_accepted, tokens, result = verify(logits, np.zeros((n, 3)), np.zeros(n), params, num_generated=generated,
                                          num_logprobs=5)
    batch = SamplingBatch.from_params(params, n, num_generated=generated, request_ids=range(n),
                                      eos_token_ids=[EOS], engine_seed=5)
    want = sampling.sample(jnp.asarray(logits[:, 0]), batch, jnp.zeros((n, vocab), jnp.int32),
                           jnp.zeros((n, vocab), bool), num_logprobs=5)
    assert (num_accepted == 0).all()
    np.testing.assert_array_equal(tokens[:, 0], np.asarray(want.tokens))
    assert (tokens[:, 1:] == -1).all()
    np.testing.assert_allclose(np.asarray(result.logprob)[:, 0], np.asarray(want.logprob), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(result.top_ids)[:, 0], np.asarray(want.top_ids))


@pytest.mark.parametrize("probabilistic", [False, True], ids=["greedy-drafts", "probabilistic-drafts"])
def test_greedy_rows_accept_the_prefix_that_matches_the_argmax(probabilistic):
    rng = np.random.default_rng(1)
    n, k, vocab = 24, 4, 29
    params = [SamplingParams(temperature=0.0) if i % 3 else SamplingParams(temperature=0.8) for i in range(n)]
    logits = rng.normal(size=(n, k + 1, vocab)).astype(np.float32)
    argmax = logits.argmax(-1)
    drafts = argmax[:, :k].copy()
    wrong = rng.random((n, k)) < 0.3
    drafts[wrong] = (drafts[wrong] + 1) % vocab
    num_drafts = rng.integers(0, k + 1, n)
    draft_logits = rng.normal(size=(n, k, vocab)).astype(np.float32) if probabilistic else None
    num_accepted, tokens, _ = verify(logits, drafts, num_drafts, params, draft_logits=draft_logits)
    for i in range(n):
        if params[i].temperature:
            continue
        a = 0
        while a < num_drafts[i] and drafts[i, a] == argmax[i, a]:
            a += 1
        assert num_accepted[i] == a
        assert tokens[i, :a + 1].tolist() == [*drafts[i, :a], argmax[i, a]]
        assert (tokens[i, a + 1:] == -1).all()


def test_penalties_and_min_tokens_inside_a_window_match_token_by_token_sampling():
    """Drafts equal to what the one-token sampler picks step by step (counts updated, min_tokens
    counted per position) are all accepted, and the bonus is that sampler's next token."""
    rng = np.random.default_rng(2)
    k, vocab = 4, 11
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.6, presence_penalty=0.4),
              SamplingParams(temperature=0.0, repetition_penalty=1.8, min_tokens=3),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])]
    n = len(params)
    logits = rng.normal(size=(n, k + 1, vocab)).astype(np.float32) * 0.3
    logits[:, :, EOS] += 2.0  # EOS wins wherever it is not banned
    logits[:, :, 7] += 1.0
    counts = rng.integers(0, 2, (n, vocab)).astype(np.int32)
    prompt_mask = rng.random((n, vocab)) < 0.3
    generated = [0, 1, 0]
    want = np.zeros((n, k + 1), np.int32)
    running = counts.copy()
    for j in range(k + 1):
        batch = SamplingBatch.from_params(params, n, num_generated=[g + j for g in generated], request_ids=range(n),
                                          eos_token_ids=[EOS])
        picked = np.asarray(sampling.sample(jnp.asarray(logits[:, j]), batch, jnp.asarray(running),
                                            jnp.asarray(prompt_mask)).tokens)
        want[:, j] = picked
        running[np.arange(n), picked] += 1
    assert len(set(want.ravel().tolist())) > 2  # the penalties and bans did move the argmax
    num_accepted, tokens, _ = verify(logits, want[:, :k], np.full(n, k), params, num_generated=generated,
                                     output_counts=counts, prompt_mask=prompt_mask)
    assert (num_accepted == k).all()
    np.testing.assert_array_equal(tokens, want)


def _target_probs(logits, params):
    """NumPy: the distribution a sampled row draws from (temperature, min-p, top-k, top-p)."""
    scaled = logits / params.temperature
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    keep = p >= params.min_p * p.max()
    if params.top_k > 0:
        keep &= p >= np.sort(p)[-params.top_k]
    order = np.argsort(p)
    tail = np.cumsum(np.where(keep[order], p[order], 0) / p[keep].sum())
    dropped = order[tail <= 1 - params.top_p + 1e-7][:len(p) - 1]
    keep[dropped] = False
    return np.where(keep, p, 0) / p[keep].sum()


@pytest.mark.parametrize("case", ["greedy-drafts", "probabilistic-drafts", "filtered-target"])
def test_emitted_tokens_follow_the_target_distribution(case):
    rng = np.random.default_rng(3)
    trials, k, vocab = 30000, 2, 6
    target = rng.normal(size=(k + 1, vocab)).astype(np.float32)
    params = (SamplingParams(temperature=1.5, top_k=4, top_p=0.9) if case == "filtered-target"
              else SamplingParams(temperature=1.0))
    p = np.stack([_target_probs(target[j].astype(np.float64), params) for j in range(k + 1)])
    assert ((p > 0).sum(-1) >= 3).all()  # a distribution, not a point: the chi-square tests mean something
    if case == "greedy-drafts":
        draft_logits, q = None, None
        drafts = np.tile(np.argsort(p[:k], axis=-1)[:, -2], (trials, 1))  # the second most likely token
    else:
        raw = rng.normal(size=(k, vocab)).astype(np.float32)
        q = np.exp(raw / params.temperature)
        q /= q.sum(-1, keepdims=True)
        drafts = np.stack([rng.choice(vocab, trials, p=q[j]) for j in range(k)], axis=1)
        draft_logits = np.broadcast_to(raw, (trials, k, vocab))
    logits = np.broadcast_to(target, (trials, k + 1, vocab))
    num_accepted, tokens, _ = verify(logits, drafts, np.full(trials, k), [params] * trials, draft_logits=draft_logits)

    def assert_distributed_as(samples, probs):
        observed = np.bincount(samples, minlength=vocab)
        support = probs > 0
        assert observed[~support].sum() == 0  # nothing the filters removed
        assert stats.chisquare(observed[support], probs[support] * len(samples)).pvalue > 1e-4

    assert_distributed_as(tokens[:, 0], p[0])
    assert_distributed_as(tokens[num_accepted >= 1, 1], p[1])  # given the first draft was accepted
    q0 = np.eye(vocab)[drafts[0, 0]] if q is None else q[0]
    expected_rate = np.minimum(p[0], q0).sum()
    rate = (num_accepted >= 1).mean()
    assert abs(rate - expected_rate) < 4.5 * np.sqrt(expected_rate * (1 - expected_rate) / trials)


def test_a_draft_distribution_equal_to_the_target_is_always_accepted():
    rng = np.random.default_rng(4)
    n, k, vocab = 200, 3, 9
    raw = rng.normal(size=(n, k + 1, vocab)).astype(np.float32)
    drafts = rng.integers(0, vocab, (n, k))
    num_accepted, tokens, _ = verify(raw, drafts, np.full(n, k), [SamplingParams(temperature=1.0)] * n,
                                     draft_logits=raw[:, :k])
    assert (num_accepted == k).all()
    np.testing.assert_array_equal(tokens[:, :k], drafts)
