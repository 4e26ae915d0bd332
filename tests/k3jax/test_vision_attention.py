"""The tower's blockwise attention (online softmax over key blocks) against plain softmax attention
written in NumPy (tests/k3jax/test_vision.py runs the whole tower at a small block against the NumPy
MoonViT reference)."""

import jax
import numpy as np
import pytest

from k3jax.vision.tower import attention


def softmax_attention(q, k, v, valid):
    """Every query over the valid keys, in float64: [N, heads, d] -> [N, heads, d]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    scores[:, :, ~valid] = -np.inf
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", weights / weights.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("n, valid, block", [
    (37, 37, 8),  # 37 keys: four full blocks and one of 5
    (37, 30, 8),  # padding keys from 30 on, inside the fourth block; the fifth is all padding
    (37, 30, 64),  # one block larger than N: full attention
    (48, 3, 16),  # padding fills the second and third blocks whole
])
def test_blockwise_attention_matches_softmax_attention(n, valid, block):
    rng = np.random.default_rng(n + valid + block)
    q, k, v = (rng.standard_normal((n, 2, 24)).astype(np.float32) * s for s in (3.0, 3.0, 1.0))  # peaked scores
    mask = np.arange(n) < valid
    out = np.asarray(jax.jit(attention, static_argnames="block_size")(q, k, v, mask, block_size=block))
    np.testing.assert_allclose(out, softmax_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)
