"""The paged DSpark draft (inject_context in chunks, then propose) against the contiguous NumPy
reference in tests/k3jax/dspark/reference.py; the Markov head against a Python loop; probabilistic
drafting against softmax(draft_logits / T)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from k3jax.dspark import model as dd
from k3jax.dspark.config import DSparkConfig
from k3jax.dspark.markov import markov_sample
from k3jax.layers import mla
from k3jax.presets import DRAFT_PRESETS
from tests.k3jax.dspark import reference as ref

PAGE_SIZE, NUM_PAGES, CHUNK = 4, 40, 6


@pytest.fixture(scope="module")
def cfg():
    return DSparkConfig.from_dict({**DRAFT_PRESETS["k3-tiny-dspark"], "logit_scale": 0.7})


@pytest.fixture(scope="module")
def setup(cfg):
    """A draft whose every parameter (norms included) is random, and a random shared head."""
    draft = dd.DSparkDraft(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    graphdef, state = nnx.split(draft)
    state = jax.tree.map(lambda v: jnp.asarray(v + 0.3 * rng.standard_normal(v.shape), jnp.float32), state)
    draft = nnx.merge(graphdef, state)
    v, h = cfg.vocab_size, cfg.hidden_size
    head = dd.SharedHead(jnp.asarray(rng.standard_normal((v, h)), jnp.float32),
                         jnp.asarray(rng.standard_normal((h, v)).T * h ** -0.5, jnp.float32), 1.3)  # [V, H]
    return draft, head


def run_paged(cfg, draft, head, taps, lengths, rng, **propose_args):
    """Injects each row's taps in chunks of CHUNK tokens, then proposes at position = length.
    Rows with length None are padding (page table all null, nothing valid)."""
    n = len(lengths)
    k = cfg.block_size
    table_width = (max(x or 0 for x in lengths) + k + PAGE_SIZE - 1) // PAGE_SIZE
    free = list(rng.permutation(np.arange(1, NUM_PAGES)))
    table = np.zeros((n, table_width), np.int32)
    for i, length in enumerate(lengths):
        if length is not None:
            need = -(-(length + k) // PAGE_SIZE)
            table[i, :need] = [free.pop() for _ in range(need)]
    pages = dd.init_draft_pages(cfg, NUM_PAGES, PAGE_SIZE, jnp.float32)
    inject = jax.jit(dd.inject_context)
    for start in range(0, max(x or 0 for x in lengths), CHUNK):
        t = np.arange(start, start + CHUNK)
        valid = np.array([t < (x or 0) for x in lengths])
        pages = inject(draft, pages, jnp.asarray(taps[:, start:start + CHUNK]), jnp.asarray(valid),
                       jnp.full((n,), start, jnp.int32), jnp.asarray(table))
    bonus = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
    positions = np.array([x or 0 for x in lengths], np.int32)
    propose = jax.jit(dd.propose, static_argnames=("greedy_only", "num_tokens"))
    drafts, logits, pages = propose(draft, pages, jnp.asarray(bonus), jnp.asarray(positions), jnp.asarray(table),
                                    head, **propose_args)
    return bonus, table, np.asarray(drafts), np.asarray(logits), pages


def assert_same_greedy(drafts, want_drafts, want_logits, rtol, atol):
    """Greedy drafts equal the float64 reference's, on inputs whose every step's top two logits are
    further apart than the logits' tolerance lets them move (the identity then holds on any machine)."""
    top2 = np.sort(want_logits, -1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0] > 2 * (atol + rtol * np.abs(top2).max(-1))).all(), "a near-tie: other inputs"
    np.testing.assert_array_equal(drafts, want_drafts)


def greedy_args(n):
    return {"temperature": jnp.zeros((n,), jnp.float32), "keys": jax.random.split(jax.random.key(0), n),
            "greedy_only": True}


@pytest.mark.parametrize("num_tokens, fold_rows", [(None, mla.FOLD_ROWS), (3, mla.FOLD_ROWS), (None, 16)])
def test_paged_draft_matches_contiguous_reference(cfg, setup, num_tokens, fold_rows, monkeypatch, request):
    """Rows of different lengths injected in chunks over a random page assignment, with a padding row;
    num_tokens shortens the block (a reference with that block size); a small fold_rows splits the
    block's rows over several attention calls."""
    monkeypatch.setattr(mla, "FOLD_ROWS", fold_rows)
    jax.clear_caches()  # FOLD_ROWS is read at trace time; traces with another value must not be reused
    request.addfinalizer(jax.clear_caches)
    draft, head = setup
    rng = np.random.default_rng(2)
    lengths = [9, None, 14, 3]
    taps = rng.standard_normal((len(lengths), 18, cfg.context_width)).astype(np.float32)
    bonus, table, drafts, logits, pages = run_paged(cfg, draft, head, taps, lengths, rng, num_tokens=num_tokens,
                                                    **greedy_args(len(lengths)))
    if num_tokens is not None:
        cfg = dataclasses.replace(cfg, block_size=num_tokens)
    p = ref.params_of(draft)
    head64 = tuple(np.asarray(a, np.float64) for a in head[:2]) + (head.logit_scale,)
    stored = np.asarray(pages.pages)
    for i, length in enumerate(lengths):
        if length is None:
            continue
        context = ref.context_kv(p, cfg, taps[i, :length].astype(np.float64), np.arange(length))
        base, _ = ref.block_logits(p, cfg, head64, context, int(bonus[i]), length)
        want_drafts, want_logits = ref.markov_greedy(base, int(bonus[i]), p["markov_w1"], p["markov_w2"],
                                                     cfg.logit_scale)
        np.testing.assert_allclose(logits[i], want_logits, rtol=2e-4, atol=2e-4)
        assert_same_greedy(drafts[i], want_drafts, want_logits, rtol=2e-4, atol=2e-4)
        # the pages hold the context rows and then the block's own rows, at the row's page-table slots
        for l in range(cfg.num_hidden_layers):
            t = np.arange(length)
            got = stored[l, table[i, t // PAGE_SIZE], t % PAGE_SIZE]
            np.testing.assert_allclose(got, context[l], rtol=1e-4, atol=1e-4)
    assert drafts.dtype == np.int32 and logits.dtype == np.float32
    assert logits.shape == (len(lengths), cfg.block_size, cfg.vocab_size)
    # nothing was written outside the rows' pages and the null page
    used = set(table[table > 0].tolist()) | {0}
    untouched = [q for q in range(NUM_PAGES) if q not in used]
    assert not np.any(stored[:, untouched])


def test_block_rows_are_written_at_their_positions(cfg, setup):
    """propose writes the block's own KV rows into the draft pages at p..p+K-1, after the context's."""
    draft, head = setup
    rng = np.random.default_rng(3)
    lengths = [5]
    taps = rng.standard_normal((1, 6, cfg.context_width)).astype(np.float32)
    bonus, table, _, _, pages = run_paged(cfg, draft, head, taps, lengths, rng, **greedy_args(1))
    p = ref.params_of(draft)
    stored = np.asarray(pages.pages)
    t = np.arange(5 + cfg.block_size)
    rows = stored[:, table[0, t // PAGE_SIZE], t % PAGE_SIZE]  # [L, p + K, C]
    head64 = tuple(np.asarray(a, np.float64) for a in head[:2]) + (head.logit_scale,)
    context = ref.context_kv(p, cfg, taps[0, :5].astype(np.float64), np.arange(5))
    _, block_rows = ref.block_logits(p, cfg, head64, context, int(bonus[0]), 5)
    for l in range(cfg.num_hidden_layers):
        np.testing.assert_allclose(rows[l, :5], context[l], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(rows[l, 5:], block_rows[l], rtol=2e-4, atol=2e-4)


def test_markov_greedy_equals_python_loop():
    rng = np.random.default_rng(4)
    n, k, v, r = 3, 5, 50, 4
    base = rng.standard_normal((n, k, v)).astype(np.float32)
    w1, w2 = rng.standard_normal((v, r)).astype(np.float32), rng.standard_normal((v, r)).astype(np.float32)
    bonus = rng.integers(0, v, n).astype(np.int32)
    drafts, logits = markov_sample(jnp.asarray(base), jnp.asarray(bonus), jnp.asarray(w1), jnp.asarray(w2), 0.5,
                                      jnp.zeros((n,), jnp.float32), jax.random.split(jax.random.key(0), n),
                                      greedy_only=True)
    for i in range(n):
        want_drafts, want_logits = ref.markov_greedy(base[i].astype(np.float64), int(bonus[i]),
                                                     w1.astype(np.float64), w2.astype(np.float64), 0.5)
        np.testing.assert_allclose(np.asarray(logits[i]), want_logits, rtol=1e-5, atol=1e-5)
        assert_same_greedy(np.asarray(drafts[i]), want_drafts, want_logits, rtol=1e-5, atol=1e-5)


def test_probabilistic_drafts_follow_draft_logits():
    """Rows with equal inputs and different keys: the first draft follows softmax(logits_0 / T); the
    second, among rows whose first draft was the commonest token, follows softmax(logits_1 / T) of those
    rows. Equal keys give equal drafts; temperature-0 rows are the greedy drafts."""
    rng = np.random.default_rng(5)
    n, k, v, r, temp = 4000, 3, 6, 2, 0.8
    base = np.broadcast_to(rng.standard_normal((1, k, v)), (n, k, v)).astype(np.float32)
    w1, w2 = rng.standard_normal((v, r)).astype(np.float32), rng.standard_normal((v, r)).astype(np.float32)
    bonus = np.full(n, 2, np.int32)
    keys = jax.random.split(jax.random.key(7), n)
    sample = jax.jit(markov_sample, static_argnames="greedy_only")
    args = (jnp.asarray(base), jnp.asarray(bonus), jnp.asarray(w1), jnp.asarray(w2), 1.0)
    drafts, logits = sample(*args, jnp.full((n,), temp, jnp.float32), keys, greedy_only=False)
    drafts, logits = np.asarray(drafts), np.asarray(logits)

    def check(tokens, row_logits):
        scaled = row_logits.astype(np.float64) / temp
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        counts = np.bincount(tokens, minlength=v)
        assert stats.chisquare(counts, probs * len(tokens)).pvalue > 1e-3

    check(drafts[:, 0], logits[0, 0])
    commonest = np.bincount(drafts[:, 0]).argmax()
    rows = np.flatnonzero(drafts[:, 0] == commonest)
    np.testing.assert_allclose(logits[rows, 1], np.broadcast_to(logits[rows[0], 1], (len(rows), v)), rtol=1e-6)
    check(drafts[rows, 1], logits[rows[0], 1])

    again, _ = sample(*args, jnp.full((n,), temp, jnp.float32), keys, greedy_only=False)
    np.testing.assert_array_equal(np.asarray(again), drafts)
    mixed = np.where(np.arange(n) % 2 == 0, 0.0, temp).astype(np.float32)
    got, _ = sample(*args, jnp.asarray(mixed), keys, greedy_only=False)
    greedy, _ = sample(*args, jnp.asarray(mixed), keys, greedy_only=True)
    np.testing.assert_array_equal(np.asarray(got)[::2], np.asarray(greedy)[::2])
    np.testing.assert_array_equal(np.asarray(got)[1::2], drafts[1::2])


@pytest.mark.parametrize("tied", [False, True])
def test_shared_head_is_the_targets(tied):
    from k3jax.config import K3Config
    from k3jax.model import K3Model

    target_cfg = K3Config.from_preset("k3-tiny").replace(tie_word_embeddings=tied, logit_scale=1.5)
    model = K3Model.random(target_cfg, dtype="float32", seed=0)
    head = dd.shared_head(model)
    embed = np.asarray(model.params["embed_tokens"][...])
    np.testing.assert_array_equal(np.asarray(head.embed), embed)
    weight = (embed if tied else np.asarray(model.params["lm_head"]["kernel"][...])).T
    h = np.random.default_rng(6).standard_normal((2, target_cfg.hidden_size)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(head.logits(jnp.asarray(h))), h @ weight * 1.5, rtol=1e-5, atol=1e-5)
