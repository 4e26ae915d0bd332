"""Whole-model consistency in fp32: prefill + decode == full forward, right padding and causality.

The tests share shapes (full forwards of [2, 20] and [3, 20], prefills of 7 tokens with room for 32)
so that each compiled program serves several of them."""

import numpy as np
import pytest

from k3jax.model import K3Model
from tests.k3jax.tiny_configs import k3_tiny, kimi_linear_tiny

# fp32 throughout; the chunked (prefill) and recurrent (decode) KDA paths and the naive and absorbed
# MLA forms differ only by reassociation, ~1e-6 relative per layer.
RTOL, ATOL = 1e-4, 1e-4
CONFIGS = {"k3-tiny": k3_tiny, "kimi-linear-tiny": kimi_linear_tiny}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return K3Model.random(CONFIGS[request.param](), dtype="float32", seed=0)


def _ids(model, shape, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, size=shape, dtype=np.int32)


def test_logits_are_finite_and_not_degenerate(model):
    logits = model.logits(_ids(model, (2, 20)))
    assert logits.shape == (2, 20, model.config.vocab_size) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert logits.std(axis=-1).min() > 1e-2  # not constant over the vocabulary
    assert len({int(t) for t in logits.argmax(-1).ravel()}) > 1


def test_prefill_then_decode_reproduces_full_forward(model):
    ids = _ids(model, (2, 20), seed=1)
    full = model.logits(ids)
    prompt = 7
    logits, cache = model.prefill(ids[:, :prompt], max_len=32)
    np.testing.assert_allclose(np.asarray(logits), full[:, :prompt], rtol=RTOL, atol=ATOL)
    for t in range(prompt, ids.shape[1]):
        step, cache = model.decode(ids[:, t], cache)
        np.testing.assert_allclose(np.asarray(step), full[:, t], rtol=RTOL, atol=ATOL, err_msg=f"position {t}")
    np.testing.assert_array_equal(np.asarray(cache.lengths), [20, 20])


def test_chunked_prefill_continues_the_cache(model):
    ids = _ids(model, (2, 20), seed=2)
    full = model.logits(ids)
    first, cache = model.prefill(ids[:, :7], max_len=32)
    second, cache = model.prefill(ids[:, 7:], cache=cache)
    np.testing.assert_allclose(np.concatenate([first, second], 1), full, rtol=RTOL, atol=ATOL)


def test_right_padding_changes_nothing(model):
    lengths = [13, 5, 9]
    ids = _ids(model, (3, 13), seed=3)
    padded = ids.copy()
    for b, n in enumerate(lengths):
        padded[b, n:] = (b + 7) % model.config.vocab_size  # arbitrary filler
    batched, cache = model.prefill(padded, lengths=np.asarray(lengths), max_len=20)
    nxt = _ids(model, (3,), seed=4)
    step, _ = model.decode(nxt, cache)
    # Each row alone: its tokens and the next one, then anything (causality: the next test).
    alone_ids = _ids(model, (3, 20), seed=7)
    for b, n in enumerate(lengths):
        alone_ids[b, :n + 1] = np.append(ids[b, :n], nxt[b])
    alone = model.logits(alone_ids)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(batched)[b, :n], alone[b, :n], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.asarray(step)[b], alone[b, n], rtol=RTOL, atol=ATOL)


def test_future_tokens_never_change_past_logits(model):
    ids = _ids(model, (1, 20), seed=5)
    other = ids.copy()
    other[:, 9:] = _ids(model, (1, 11), seed=6)
    a, b = np.split(model.logits(np.concatenate([ids, other])), 2)
    np.testing.assert_allclose(a[:, :9], b[:, :9], rtol=RTOL, atol=ATOL)
    assert np.abs(a[:, 9:] - b[:, 9:]).max() > 1e-3


def test_bad_input_ids_are_rejected(model):
    with pytest.raises(ValueError, match="outside"):
        model.logits([[0, model.config.vocab_size]])
    with pytest.raises(ValueError, match="lengths"):
        model.prefill(_ids(model, (2, 3)), lengths=[3])
