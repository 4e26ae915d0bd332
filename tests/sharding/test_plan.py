"""The memory plan reads the same tables the code uses."""

import pytest

from k3jax.config import K3Config
from k3jax.plan import plan
from k3jax.sizing import kda_state_bytes_per_sequence, mla_cache_bytes_per_token, param_count


def test_kimi_k3_on_8x2():
    cfg = K3Config.from_preset("kimi-k3")
    p = plan(cfg, "8x2", device_bytes=141e9)
    # the MLA latent cache is split by sequence over data, whole on each model rank
    assert p["mla_cache_MiB_per_1k_tokens"] == pytest.approx(mla_cache_bytes_per_token(cfg) * 1024 / 2**20)
    # KDA recurrent state and conv window both split by head over model=8: K3's 53.57 MiB per sequence
    assert p["kda_state_MiB_per_sequence"] * 2**20 == pytest.approx(kda_state_bytes_per_sequence(cfg, tensor_parallel=8))
    # bf16 weights with MXFP4 experts: at least an even 16-way split of the checkpoint bytes
    assert p["weights_GiB"] * 2**30 > 1.4e12 / 16
    # one 1M-token sequence per data shard needs its KDA state plus 1M tokens of MLA cache
    per_1m = p["kda_state_MiB_per_sequence"] * 2**20 + p["mla_cache_MiB_per_1k_tokens"] * 2**20 * 1024
    assert p["concurrent_1M"] == int(p["free_GiB"] * 2**30 // per_1m) * 2
    # without DP attention each of the 2 data groups would hold every sequence: half as many fit
    assert p["concurrent_1M_without_dp_attention"] == p["concurrent_1M"] // 2
    assert p["concurrent_8K"] > p["concurrent_128K"] > p["concurrent_1M"] > 0


def test_the_plan_refuses_a_mesh_that_does_not_divide():
    with pytest.raises(ValueError, match="96 KDA heads do not divide over model=7"):
        plan(K3Config.from_preset("kimi-k3"), "7x2")
    tiny = K3Config.from_preset("k3-tiny")
    # replicated or split, the per-device weights never exceed the whole model in bf16 (MXFP4 smaller)
    assert 0 < plan(tiny, "8x2")["weights_GiB"] * 2**30 <= 2 * param_count(tiny)
