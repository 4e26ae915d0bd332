"""k3jax.sampling_noise: the hash written in NumPy from its description, and the noise's law (Gumbel,
uncorrelated across entries, rows and steps) checked by closed-form moments and a KS test."""

import jax
import numpy as np
from scipy import stats

from k3jax.sampling_noise import gumbel_noise
from serve import sampling
from tests.agreement import gumbel_noise_reference

VOCAB = 163_840  # K3's vocabulary: the indices cover the hash's whole input range in use


def step_keys(seed: int, steps: int) -> jax.Array:
    """The keys the serving sampler gives one seeded request at num_generated = 0..steps-1."""
    batch = sampling.SamplingBatch.from_params([sampling.SamplingParams(temperature=1.0, seed=seed)] * steps, steps,
                                               num_generated=list(range(steps)), request_ids=[0] * steps)
    return sampling.row_keys(batch)


def test_noise_is_the_documented_hash():
    keys = step_keys(seed=7, steps=3)
    noise = np.asarray(jax.jit(jax.vmap(lambda key: gumbel_noise(key, VOCAB)))(keys))
    for key, row in zip(keys, noise):
        expected = gumbel_noise_reference(np.asarray(jax.random.key_data(key)), VOCAB)
        np.testing.assert_allclose(row, expected, rtol=2e-6, atol=2e-6)


def test_noise_is_standard_gumbel_and_uncorrelated():
    steps = 8
    noise = np.asarray(jax.vmap(lambda key: gumbel_noise(key, VOCAB))(step_keys(seed=0, steps=steps)), np.float64)
    flat = noise.ravel()
    n = flat.size
    # Closed-form moments of the standard Gumbel: mean Euler's gamma, variance pi^2 / 6.
    assert abs(flat.mean() - np.euler_gamma) < 5 * np.pi / np.sqrt(6 * n)
    assert abs(flat.var() - np.pi ** 2 / 6) < 5 * np.sqrt((12 / 5 * np.pi ** 4 / 36 + 2 * (np.pi ** 2 / 6) ** 2) / n)
    # Its CDF exp(-exp(-g)) is uniform (the 23-bit grid is far finer than the KS statistic's scale).
    assert stats.kstest(np.exp(-np.exp(-flat)), "uniform").pvalue > 1e-4
    # No correlation between neighbouring entries, nor between one step's row and the next's.
    bound = 5 / np.sqrt(VOCAB)
    for a, b in [(noise[:, :-1], noise[:, 1:]), (noise[:-1], noise[1:])]:
        for x, y in zip(a, b):
            assert abs(np.corrcoef(x, y)[0, 1]) < bound
