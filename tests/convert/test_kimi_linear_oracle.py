"""A Kimi Linear checkpoint saved by transformers' KimiLinearForCausalLM loads and reproduces the
logits transformers computed for it (tests/fixtures/README.md says how the fixture was made)."""

import pathlib

import numpy as np
import pytest

import k3jax

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "kimi_linear_tiny"


@pytest.fixture(scope="module")
def model():
    return k3jax.from_pretrained(FIXTURE, dtype="float32")


@pytest.fixture(scope="module")
def expected():
    return np.load(FIXTURE / "reference.npz")


def test_full_forward_logits_match_transformers(model, expected):
    logits = model.logits(expected["input_ids"])
    scale = np.abs(expected["logits"]).max()
    np.testing.assert_allclose(logits, expected["logits"], rtol=1e-4, atol=1e-4 * scale)


def test_greedy_generation_matches_transformers(model, expected):
    """Prefill + cached decode steps: the same tokens and the same per-step logits as transformers' generate."""
    prompt, want = expected["gen_prompt"].reshape(1, -1), expected["gen_ids"].reshape(-1)
    step_logits = expected["gen_step_logits"]
    logits, cache = model.prefill(prompt, max_len=prompt.shape[1] + len(want))
    steps = [np.asarray(logits)[0, -1]]
    for token in want[:-1]:
        step, cache = model.decode(np.asarray([token]), cache)
        steps.append(np.asarray(step)[0])
    np.testing.assert_array_equal(np.argmax(steps, -1), want)
    np.testing.assert_allclose(steps, step_logits, rtol=1e-4, atol=1e-4 * np.abs(step_logits).max())
