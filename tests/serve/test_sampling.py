"""The sampler against NumPy references (float64, vLLM V1's order written out step by step) and
statistical checks on 2000 draws; reproducibility of per-request seeds; one compilation per shape."""

import numpy as np
import pytest

from serve.sampling import (MAX_LOGPROBS, SamplingBatch, SamplingParams, apply_penalties, argmax, sample,
                            token_counts, update_counts)

B, V = 16, 64  # most tests share this shape, so they share one compilation
NUM_DRAWS = 2000
rng = np.random.default_rng(0)
LOGITS = (1.5 * rng.standard_normal((B, V))).astype(np.float32)


def batch_of(params, bucket_size=None, *, num_generated=None, request_ids=None, **kwargs):
    bucket_size = bucket_size or len(params)
    num_generated = [0] * len(params) if num_generated is None else num_generated
    request_ids = range(len(params)) if request_ids is None else request_ids
    return SamplingBatch.from_params(params, bucket_size, num_generated=num_generated,
                                     request_ids=request_ids, **kwargs)


def run(logits, batch, counts=None, prompt_mask=None, num_logprobs=0):
    counts = np.zeros(logits.shape, np.int32) if counts is None else counts
    prompt_mask = np.zeros(logits.shape, bool) if prompt_mask is None else prompt_mask
    result = sample(logits, batch, counts, prompt_mask, num_logprobs=num_logprobs)
    return [np.asarray(x) for x in result]


# NumPy references ---------------------------------------------------------------------------------

def ref_log_softmax(x):
    x = np.asarray(x, np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def ref_penalise(logits, counts, prompt_mask, p: SamplingParams):
    x = np.asarray(logits, np.float64)
    seen = prompt_mask | (counts > 0)
    x = np.where(seen & (x > 0), x / p.repetition_penalty, x)
    x = np.where(seen & (x <= 0), x * p.repetition_penalty, x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def ref_distribution(logits, p: SamplingParams):
    """The distribution a non-greedy row draws from: temperature, min-p, top-k, top-p, renormalising
    after each filter (vLLM V1's order)."""
    probs = np.exp(ref_log_softmax(np.asarray(logits, np.float64) / p.temperature))
    probs[probs < p.min_p * probs.max()] = 0
    probs /= probs.sum()
    if p.top_k > 0:
        probs[probs < np.sort(probs)[-p.top_k]] = 0
        probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    probs[order[mass_before >= p.top_p]] = 0
    return probs / probs.sum()


# Sampling ------------------------------------------------------------------------------------------

def test_greedy_is_argmax():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6, top_k=3)] * (B // 2)
    tokens, *_ = run(LOGITS, batch_of(params))
    np.testing.assert_array_equal(tokens, LOGITS.argmax(-1))


def test_greedy_rows_in_a_random_batch_are_argmax():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5)] * (B // 2)
    tokens, *_ = run(LOGITS, batch_of(params))
    np.testing.assert_array_equal(tokens[::2], LOGITS[::2].argmax(-1))


def test_argmax_takes_the_first_of_ties_as_numpy_does():
    # integer-valued logits: many ties; a row of -inf (everything banned) and one holding +inf
    x = rng.integers(-3, 4, (8, 1000)).astype(np.float32)
    x[1] = -np.inf
    x[2, [17, 400]] = np.inf
    np.testing.assert_array_equal(np.asarray(argmax(x)), x.argmax(-1))
    assert 0 <= int(argmax(np.full((1, 5), np.nan, np.float32))[0]) < 5  # in range, whatever it is


def test_no_logprobs_samples_the_same_tokens():
    params = [SamplingParams(temperature=t, seed=i, top_p=0.9) for i, t in enumerate([0.0, 0.8] * (B // 2))]
    batch = batch_of(params)
    counts, prompt_mask = np.zeros((B, V), np.int32), np.zeros((B, V), bool)
    without = sample(LOGITS, batch, counts, prompt_mask, num_logprobs=None)
    assert without.logprob is None and without.top_ids is None
    np.testing.assert_array_equal(np.asarray(without.tokens), run(LOGITS, batch)[0])


STATISTICAL_CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.3, top_k=5),
    "top_p": SamplingParams(top_p=0.8),
    "min_p": SamplingParams(min_p=0.1),
    "all_filters": SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05),
    "penalties": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3,
                                top_p=0.95),
}


@pytest.mark.parametrize("name", STATISTICAL_CASES)
def test_draws_follow_the_filtered_distribution(name):
    params = STATISTICAL_CASES[name]
    logits = np.repeat(LOGITS[:1], NUM_DRAWS, axis=0)
    counts = np.zeros_like(logits, np.int32)
    counts[:, [int(LOGITS[0].argmax()), 7, 9]] = [1, 2, 1]  # only "penalties" looks at these
    prompt_mask = np.zeros_like(logits, bool)
    prompt_mask[:, [3, 7, 11]] = True
    tokens, *_ = run(logits, batch_of([params] * NUM_DRAWS), counts, prompt_mask)

    expected = ref_distribution(ref_penalise(LOGITS[0], counts[0], prompt_mask[0], params), params)
    assert set(tokens) <= set(np.flatnonzero(expected)), "a draw outside the allowed set"
    observed = np.bincount(tokens, minlength=V)
    mean, std = NUM_DRAWS * expected, np.sqrt(NUM_DRAWS * expected * (1 - expected))
    assert np.all(np.abs(observed - mean) <= 4 * std + 1), (observed, mean.round(1))


def test_min_p_cuts_before_top_p():
    # Probabilities .5, .3, .2: min-p 0.5 drops .2, leaving .625 and .375, so top-p 0.6 keeps only the
    # first token. Top-p before min-p (vLLM V0, SGLang) would keep two.
    logits = np.full((B, V), -np.inf, np.float32)
    logits[:, :3] = np.log([0.5, 0.3, 0.2])
    tokens, *_ = run(logits, batch_of([SamplingParams(min_p=0.5, top_p=0.6)] * B))
    np.testing.assert_array_equal(tokens, 0)


def test_top_k_minus_one_and_zero_are_off():
    runs = [run(LOGITS, batch_of([SamplingParams(top_k=k, seed=5)] * B))[0] for k in (-1, 0, V)]
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


# Penalties and banned tokens ------------------------------------------------------------------------

def test_penalties_match_numpy():
    logits = np.array([[2.0, -1.0, 0.0, 3.0, -2.5, 0.5, 1.0, -0.25]] * 2, np.float32)
    counts = np.array([[0, 2, 0, 1, 0, 0, 3, 0], [1, 0, 0, 0, 0, 2, 0, 0]], np.int32)
    prompt_mask = np.array([[1, 0, 1, 0, 1, 0, 0, 0], [0, 1, 0, 0, 1, 0, 0, 1]], bool)
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.5),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=-1.0)]
    got = np.asarray(apply_penalties(logits, batch_of(params), counts, prompt_mask))
    want = [ref_penalise(logits[i], counts[i], prompt_mask[i], p) for i, p in enumerate(params)]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_no_penalty_inputs_sample_as_zero_ones():
    """None for the counts and prompt mask (the engine's batches without penalties) is the same
    sampler as all-zero arrays: tokens, logprobs and alternatives."""
    params = [SamplingParams(temperature=t, top_k=k, seed=i) for i, (t, k) in
              enumerate(zip([0.0, 0.8, 1.3, 0.5] * (B // 4), [0, 0, 5, 3] * (B // 4)))]
    batch = batch_of(params)
    want = run(LOGITS, batch, num_logprobs=3)
    got = [np.asarray(x) for x in sample(LOGITS, batch, None, None, num_logprobs=3)]
    np.testing.assert_array_equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_greedy_uses_penalised_logits():
    logits = np.full((B, V), -5.0, np.float32)
    logits[:, :2] = [[3.0, 2.9]] * B
    logits[1::2, :2] = [-1.0, -1.1]  # negative logits are multiplied, not divided
    prompt_mask = np.zeros((B, V), bool)
    prompt_mask[:, 0] = True
    tokens, *_ = run(logits, batch_of([SamplingParams(temperature=0, repetition_penalty=1.2)] * B),
                     prompt_mask=prompt_mask)
    np.testing.assert_array_equal(tokens, 1)


def test_min_tokens_bans_eos_and_stop_ids():
    logits = np.zeros((B, V), np.float32)
    logits[:, [2, 5, 9]] = [3.0, 2.0, 1.0]  # EOS (2) first, then stop id 5, then 9
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], ignore_eos=True),
              SamplingParams(min_tokens=3, stop_token_ids=[5], top_k=1)] * (B // 2)
    for num_generated, want in [(0, 9), (2, 9), (3, 2)]:
        batch = batch_of(params, num_generated=[num_generated] * B, eos_token_ids=[2])
        tokens, *_ = run(logits, batch)
        np.testing.assert_array_equal(tokens, want)


def test_thousands_of_stop_ids_change_no_shape_and_all_are_banned():
    """Issue 21: 3,000 stop_token_ids with min_tokens recompiled the sampler (a banned-id width that
    grew with the set); the bitmask over the vocabulary has one shape whatever a request bans."""
    plain = batch_of([SamplingParams()] * B, eos_token_ids=[2], vocab_size=V)
    many = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[t for t in range(V) if t != 40] * 47)] * B
    banning = batch_of(many, eos_token_ids=[2], vocab_size=V)
    assert [(a.shape, a.dtype) for a in plain] == [(a.shape, a.dtype) for a in banning]
    sample_compiles = sample._cache_size()
    tokens, *_ = run(LOGITS, banning)
    np.testing.assert_array_equal(tokens, 40)  # every other token is banned
    run(LOGITS, plain)
    assert sample._cache_size() - sample_compiles <= 1


def test_logit_bias_is_added_before_the_penalties_and_clamped():
    logits = np.zeros((B, V), np.float32)
    logits[:, 7] = 5.0
    params = [SamplingParams(temperature=0, logit_bias={3: 1e6, 7: -2.0}, repetition_penalty=2.0)] * B
    counts = np.zeros((B, V), np.int32)
    counts[:, 3] = 1  # 3 was generated: the repetition penalty divides its biased (positive) logit
    tokens, logprob, *_ = run(logits, batch_of(params), counts)
    assert SamplingParams(logit_bias={3: 1e6}).logit_bias == ((3, 100.0),)
    np.testing.assert_array_equal(tokens, 3)  # 100 / 2 = 50 > 5 - 2
    np.testing.assert_allclose(logprob, ref_log_softmax(logits)[:, 3], atol=1e-5)  # raw: before the bias
    tokens, *_ = run(logits, batch_of([SamplingParams(temperature=0.7, seed=1, logit_bias={9: 100.0})] * B))
    np.testing.assert_array_equal(tokens, 9)


# Logprobs ------------------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax():
    params = [SamplingParams(temperature=t, top_k=k, repetition_penalty=1.3, frequency_penalty=0.4)
              for t in (0.0, 0.5, 1.5, 2.0) for k in (0, 3, 8, 40)]
    counts = rng.integers(0, 3, (B, V)).astype(np.int32)
    tokens, logprob, top_ids, top_logprobs = run(LOGITS, batch_of(params), counts, num_logprobs=5)
    reference = ref_log_softmax(LOGITS)
    np.testing.assert_allclose(logprob, reference[np.arange(B), tokens], atol=1e-5)
    want_ids = np.argsort(-reference, axis=-1)[:, :5]
    np.testing.assert_array_equal(top_ids, want_ids)
    np.testing.assert_allclose(top_logprobs, np.take_along_axis(reference, want_ids, -1), atol=1e-5)


def test_num_logprobs_is_bounded():
    with pytest.raises(ValueError, match="num_logprobs"):
        run(LOGITS, batch_of([None] * B), num_logprobs=MAX_LOGPROBS + 1)


# Seeds and isolation -------------------------------------------------------------------------------

TARGET_LOGITS = (0.3 * rng.standard_normal(V)).astype(np.float32)  # near uniform: many tokens likely


def draw_target(target, others, row, bucket_size, *, engine_seed=0, request_id=7, steps=6):
    """Tokens of `target` over `steps` steps, placed at `row` among `others`."""
    params = list(others)
    params.insert(row, target)
    ids = [100 + i for i in range(len(params))]
    ids[row] = request_id
    logits = (2.0 * rng.standard_normal((bucket_size, V))).astype(np.float32)
    logits[row] = TARGET_LOGITS
    out = []
    for step in range(steps):
        batch = batch_of(params, bucket_size, num_generated=[step] * len(params), request_ids=ids,
                         engine_seed=engine_seed)
        out.append(int(run(logits, batch)[0][row]))
    return out


def test_seeded_tokens_do_not_depend_on_row_neighbours_or_bucket():
    # The neighbours switch the batch between the sorting and the sort-free filter paths.
    target = SamplingParams(seed=1234, min_p=0.01)
    first = draw_target(target, [SamplingParams(temperature=0), SamplingParams(top_k=3), None], 0, B)
    moved = draw_target(target, [SamplingParams(min_p=0.2, seed=9)] * 9, 6, B)
    small_bucket = draw_target(target, [SamplingParams(top_p=0.5)], 1, 4)
    assert first == moved == small_bucket
    assert draw_target(SamplingParams(seed=1235, min_p=0.01), [], 0, B) != first
    assert len(set(first)) > 1  # the step index moves the key


def test_unseeded_rows_follow_engine_seed_and_request_id():
    target = SamplingParams()
    first = draw_target(target, [SamplingParams(top_k=2)], 1, B)
    assert draw_target(target, [None, None, SamplingParams(seed=3)], 0, B) == first
    assert draw_target(target, [], 0, B, request_id=8) != first
    assert draw_target(target, [], 0, B, engine_seed=1) != first


def test_padding_rows_never_affect_other_rows():
    params = [SamplingParams(), SamplingParams(top_p=0.7, seed=1), SamplingParams(temperature=0)]
    batch = batch_of(params, B)
    garbage = LOGITS.copy()
    garbage[len(params):] = np.nan
    garbage[len(params)::2] = np.inf
    clean, dirty = run(LOGITS, batch, num_logprobs=3), run(garbage, batch, num_logprobs=3)
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(a[:len(params)], b[:len(params)])


def test_one_compilation_for_any_parameter_values():
    bucket, vocab = 12, 96  # a shape no other test uses
    logits = rng.standard_normal((bucket, vocab)).astype(np.float32)
    counts = rng.integers(0, 2, (bucket, vocab)).astype(np.int32)
    batches = [
        batch_of([SamplingParams(temperature=0)] * bucket),
        batch_of([SamplingParams(top_k=5, seed=1), None, SamplingParams(min_p=0.3)], bucket),
        batch_of([SamplingParams(top_p=0.5, repetition_penalty=1.4, presence_penalty=1.0)] * 5, bucket,
                 num_generated=[3] * 5, request_ids=range(40, 45)),
        batch_of([SamplingParams(temperature=2.0, top_k=1000, min_tokens=4, stop_token_ids=[1, 2])],
                 bucket, num_generated=[1], eos_token_ids=[0]),
    ]
    before = sample._cache_size()
    for batch in batches:
        run(logits, batch, counts)
    assert sample._cache_size() == before + 1


# Helpers -------------------------------------------------------------------------------------------

def test_count_helpers_match_numpy():
    ids = np.array([[3, 5, 3, -1], [0, -1, -1, -1]], np.int32)
    counts = np.asarray(token_counts(ids, 8))
    want = np.zeros((2, 8), np.int32)
    np.add.at(want, (np.array([0, 0, 0, 1]), np.array([3, 5, 3, 0])), 1)
    np.testing.assert_array_equal(counts, want)
    updated = np.asarray(update_counts(counts, np.array([5, 7]), np.array([True, False])))
    want[0, 5] += 1
    np.testing.assert_array_equal(updated, want)


# SamplingParams ------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("n", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.1), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("seed", 1.5), ("max_tokens", 0), ("min_tokens", -1),
    ("stop", [""]), ("stop_token_ids", [-1]), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", -1),
    ("temperature", 1e39), ("logit_bias", {-1: 1.0}), ("logit_bias", {1: float("nan")}),
    ("logit_bias", {i: 1.0 for i in range(301)}),
])
def test_invalid_params_name_the_field(field, value):
    """The message starts with the field's API name (the HTTP server's 400s pass it on)."""
    with pytest.raises(ValueError, match=rf"^{field}: must be .*, got "):
        SamplingParams(**{field: value})


def test_params_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[4, 5])
    defaults = (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.seed, p.logprobs)
    assert defaults == (1, 1.0, 1.0, 0, 0.0, 16, None, None)
    assert p.stop == ("###",) and p.stop_token_ids == (4, 5) and SamplingParams().stop == ()
    assert SamplingParams(temperature=0).greedy and not p.greedy
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=20, max_tokens=10)
    hash(p)  # frozen and hashable
