"""Whole-model consistency in fp32: prefill + decode == full forward, right padding and causality.

Each path's logits are checked row by row against the one-device full forward of that row alone
(tests/agreement.py: fp32's tolerance, router near-ties followed; the chunked and recurrent KDA paths
and the naive and absorbed MLA forms differ by reassociation, and the random routers have decisions
closer than that). The tests share shapes (full forwards of [2, 20] and [3, 20], prefills of 7 tokens
with room for 32) so that each compiled program serves several of them."""

import numpy as np
import pytest

from k3jax.model import K3Model
from tests.agreement import Referee
from tests.k3jax.tiny_configs import k3_tiny, kimi_linear_tiny

CONFIGS = {"k3-tiny": k3_tiny, "kimi-linear-tiny": kimi_linear_tiny}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return K3Model.random(CONFIGS[request.param](), dtype="float32", seed=0)


@pytest.fixture(scope="module")
def referee(model):
    return Referee(model, pad=32)


def check_rows(referee, ids, logits, what):
    """logits [B, T, V] of ids [B, T] (or its first T tokens) against the referee, row by row."""
    for b, (row, got) in enumerate(zip(ids, np.asarray(logits))):
        referee.check_logits(row[:got.shape[0]], got, what=f"{what}, row {b}")


def _ids(model, shape, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, size=shape, dtype=np.int32)


def test_logits_are_finite_and_not_degenerate(model):
    logits = model.logits(_ids(model, (2, 20)))
    assert logits.shape == (2, 20, model.config.vocab_size) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert logits.std(axis=-1).min() > 1e-2  # not constant over the vocabulary
    assert len({int(t) for t in logits.argmax(-1).ravel()}) > 1


def test_full_forward_is_the_reference(model, referee):
    ids = _ids(model, (2, 20), seed=1)
    check_rows(referee, ids, model.logits(ids), "full forward")


def test_prefill_then_decode_reproduces_full_forward(model, referee):
    ids = _ids(model, (2, 20), seed=1)
    prompt = 7
    logits, cache = model.prefill(ids[:, :prompt], max_len=32)
    steps = [np.asarray(logits)]
    for t in range(prompt, ids.shape[1]):
        step, cache = model.decode(ids[:, t], cache)
        steps.append(np.asarray(step)[:, None])
    check_rows(referee, ids, np.concatenate(steps, 1), "prefill + decode")
    np.testing.assert_array_equal(np.asarray(cache.lengths), [20, 20])


def test_chunked_prefill_continues_the_cache(model, referee):
    ids = _ids(model, (2, 20), seed=2)
    first, cache = model.prefill(ids[:, :7], max_len=32)
    second, cache = model.prefill(ids[:, 7:], cache=cache)
    check_rows(referee, ids, np.concatenate([first, second], 1), "chunked prefill")


def test_right_padding_changes_nothing(model, referee):
    lengths = [13, 5, 9]
    ids = _ids(model, (3, 13), seed=3)
    padded = ids.copy()
    for b, n in enumerate(lengths):
        padded[b, n:] = (b + 7) % model.config.vocab_size  # arbitrary filler
    batched, cache = model.prefill(padded, lengths=np.asarray(lengths), max_len=20)
    nxt = _ids(model, (3,), seed=4)
    step, _ = model.decode(nxt, cache)
    for b, n in enumerate(lengths):  # each row as the reference runs it alone: its tokens and the next
        got = np.concatenate([np.asarray(batched)[b, :n], np.asarray(step)[b:b + 1]])
        referee.check_logits(np.append(ids[b, :n], nxt[b]), got, what=f"padded row {b}")


def test_future_tokens_never_change_past_logits(model, referee):
    ids = _ids(model, (1, 20), seed=5)
    other = ids.copy()
    other[:, 9:] = _ids(model, (1, 11), seed=6)
    a, b = np.split(model.logits(np.concatenate([ids, other])), 2)
    for row in (a, b):  # the first 9 positions: the reference's run of those 9 tokens alone
        referee.check_logits(ids[0, :9], row[0, :9], what="past positions")
    assert np.abs(a[:, 9:] - b[:, 9:]).max() > 1e-3


def test_bad_input_ids_are_rejected(model):
    with pytest.raises(ValueError, match="outside"):
        model.logits([[0, model.config.vocab_size]])
    with pytest.raises(ValueError, match="lengths"):
        model.prefill(_ids(model, (2, 3)), lengths=[3])


def test_token_logprobs_are_the_full_forwards_log_softmax(model):
    ids = np.array([[5, 7, 9, 11, 13, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]])
    chosen, ranks, top_ids, top = model.token_logprobs(ids, [5, 8], num_top=3)
    logits = model.logits(ids, [5, 8]).astype(np.float64)
    logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    for row, length in enumerate((5, 8)):
        want = logprobs[row, np.arange(length - 1), ids[row, 1:length]]
        np.testing.assert_allclose(chosen[row, :length - 1], want, atol=1e-5)
        order = np.argsort(-logprobs[row, :length - 1], axis=-1)[:, :3]
        np.testing.assert_allclose(top[row, :length - 1], np.take_along_axis(logprobs[row, :length - 1], order, -1),
                                   atol=1e-5)
        assert (top_ids[row, :length - 1, 0] == order[:, 0]).all()
        rows = logprobs[row, np.arange(length - 1)]
        np.testing.assert_array_equal(ranks[row, :length - 1], 1 + (rows > want[:, None] + 1e-5).sum(-1))
