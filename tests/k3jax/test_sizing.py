"""Parameter counts and cache sizes against the published figures and closed forms."""

import pytest

from k3jax import active_param_count, kda_state_bytes_per_sequence, mla_cache_bytes_per_token, param_count
from k3jax.config import K3Config


def test_kimi_k3_parameter_counts_match_the_published_totals():
    c = K3Config.from_preset("kimi-k3")
    assert param_count(c) == pytest.approx(2.7795e12, rel=1e-3)
    assert active_param_count(c) == pytest.approx(104.19e9, rel=1e-3)


def test_kimi_linear_48b_counts():
    c = K3Config.from_preset("kimi-linear-48b-a3b")
    assert param_count(c) == pytest.approx(48e9, rel=0.05)  # "48B total"
    assert active_param_count(c) == pytest.approx(3e9, rel=0.1)  # "A3B"


def test_cache_sizes():
    c = K3Config.from_preset("kimi-k3")
    assert mla_cache_bytes_per_token(c) == 27 * 1024  # 576 values x 2 bytes x 24 MLA layers
    assert mla_cache_bytes_per_token(c, "fp8") == 27 * 1024 // 2
    # per TP8 rank: 12 heads x 128 x 128 fp32 plus 3 x 1536 bf16 channels x 3 taps, over 69 KDA layers
    assert kda_state_bytes_per_sequence(c, tensor_parallel=8) == 69 * (12 * 128 * 128 * 4 + 3 * 1536 * 3 * 2)
    with pytest.raises(ValueError, match="96 KDA heads do not divide over tensor_parallel=7"):
        kda_state_bytes_per_sequence(c, tensor_parallel=7)
    with pytest.raises(ValueError, match="cache dtype"):
        mla_cache_bytes_per_token(c, "int3")


def test_tiny_count_equals_the_number_of_initialised_parameters():
    from flax import nnx

    from k3jax.decoder import K3Transformer

    c = K3Config.from_preset("k3-tiny")
    abstract = nnx.eval_shape(lambda: K3Transformer(c))
    _, state = nnx.split(abstract)
    counted = 0
    for path, v in nnx.to_flat_state(state):
        n = v.get_value().size
        counted += n * 2 if path[-1] == "packed" else 0 if path[-1] == "scales" else n  # 2 codes per byte
    assert param_count(c) == counted
