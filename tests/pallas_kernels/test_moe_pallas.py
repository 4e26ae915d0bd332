"""Pallas-Triton MoE expert FFN: interpret mode against reference.py, the in-kernel MXFP4 decode
against an independent bit-field decoder, the row-tile plan, and lowering for an H200 and an MI300
at K3's per-device expert shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.activations import GatedActivation
from pallas_kernels.moe import Mxfp4Tensor, expert_ffn, moe_ffn, pallas_triton
from tests.convert.test_mxfp4 import assert_same_bits, np_decode
from tests.pallas_kernels.gpu_lowering import lower_for_gpu, triton_call_count

# D = F = 256: both kernels take 2 reduction steps and 4 column blocks per decode-sized row tile,
# and an MXFP4 weight tile spans 4 scale groups.
E, F, D = 8, 256, 256
SITU = GatedActivation("situ", 4.0, 25.0)
SILU = GatedActivation("silu")
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# Tolerances relative to the largest |output| (both sides accumulate in fp32, in different orders).
# f32: sums of 256 products, each side a few 2**-24 roundings per step; 1e-5 leaves room for 8x that.
# bf16: the hidden activation and the output are rounded to bf16 (2**-9 relative); a different fp32
# order can flip such a rounding, one bf16 ulp (2**-8), so allow 2 ulps.
TOL = {"f32": 1e-5, "bf16": 2.0 ** -7}


def weights(kind, num_experts=E, seed=0):
    """w_gate, w_up [E, F, D] and w_down [E, D, F]: MXFP4 (random codes, scales giving outputs of
    order 1) or plain f32 (cast to the activation dtype by every implementation)."""
    rng = np.random.default_rng(seed)

    def one(out, inp):
        if kind == "mxfp4":
            return Mxfp4Tensor(jnp.asarray(rng.integers(0, 256, (num_experts, out, inp // 2)), jnp.uint8),
                               jnp.asarray(rng.integers(118, 122, (num_experts, out, inp // 32)), jnp.uint8))
        return jnp.asarray(rng.standard_normal((num_experts, out, inp)) / np.sqrt(inp), jnp.float32)

    return one(F, D), one(F, D), one(D, F)


def rows_of(dtype, m, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, D)), DTYPES[dtype])


def assert_close(got, want, dtype):
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=TOL[dtype] * np.abs(want).max())


def pallas_and_reference(fn, *args, activation):
    run = jax.jit(fn, static_argnames=("activation", "impl"))  # weights as arguments, not constants
    return run(*args, activation=activation, impl="pallas"), run(*args, activation=activation, impl="reference")


# M = 40 rows is not a multiple of the 16-row tile. Group sizes: empty groups and padding rows past
# the sum; every row on one expert (3 tiles, the last partial); groups ending exactly on the last
# row; all rows padding.
GROUPS_40 = [[3, 0, 7, 0, 0, 1, 16, 5], [0, 0, 0, 0, 0, 40, 0, 0], [1, 2, 3, 4, 5, 6, 7, 12], [0] * 8]


@pytest.mark.parametrize("wkind, dtype, activation", [("mxfp4", "bf16", SITU), ("plain", "f32", SILU),
                                                      ("mxfp4", "f32", SILU), ("plain", "bf16", SITU)])
def test_expert_ffn_matches_reference(wkind, dtype, activation):
    ws = weights(wkind)
    x = rows_of(dtype, 40)
    for sizes in GROUPS_40:
        got, want = pallas_and_reference(expert_ffn, x, jnp.asarray(sizes, jnp.int32), *ws, activation=activation)
        assert got.dtype == x.dtype and got.shape == x.shape
        used = sum(sizes)
        if used:
            assert_close(got[:used], want[:used], dtype)
        np.testing.assert_array_equal(np.asarray(got[used:], np.float32), 0.0)  # padding rows


def test_fewer_rows_than_a_tile():
    ws = weights("mxfp4", seed=1)
    x = rows_of("bf16", 5, seed=1)
    got, want = pallas_and_reference(expert_ffn, x, jnp.asarray([0, 2, 0, 0, 1, 0, 0, 1], jnp.int32), *ws,
                                     activation=SITU)
    assert_close(got[:4], want[:4], "bf16")
    np.testing.assert_array_equal(np.asarray(got[4:], np.float32), 0.0)


def test_tall_tiles_of_every_height():
    """260 rows over 4 experts: 128-row tiles, each running its dot at the smallest height that
    fits its rows: 128 + 2 (heights 128 and 16), 20 (32), 50 (64), 47 (64), then 13 padding rows."""
    ws = weights("mxfp4", num_experts=4, seed=2)
    x = rows_of("bf16", 260, seed=2)
    assert pallas_triton._row_tile(260, 4) == 128
    got, want = pallas_and_reference(expert_ffn, x, jnp.asarray([130, 20, 50, 47], jnp.int32), *ws, activation=SITU)
    assert_close(got[:247], want[:247], "bf16")
    np.testing.assert_array_equal(np.asarray(got[247:], np.float32), 0.0)


def test_moe_ffn_matches_reference():
    ws = weights("mxfp4", seed=3)
    rng = np.random.default_rng(3)
    tokens, k = 12, 4
    x = rows_of("bf16", tokens, seed=3)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]), jnp.int32)
    wts = jnp.asarray(rng.uniform(0, 1, (tokens, k)), jnp.float32)
    got, want = pallas_and_reference(moe_ffn, x, ids, wts, *ws, activation=SITU)
    assert got.dtype == jnp.float32 and got.shape == (tokens, D)
    assert_close(got, want, "bf16")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_in_kernel_decode_is_exact(dtype):
    """Every byte under every scale byte 2..254 against an independent decoder, bit for bit (bytes 0
    and 1 give subnormals, which the kernel and XLA:CPU flush; 255 is NaN, not used)."""
    scale_bytes = np.arange(2, 255, dtype=np.uint8)
    packed = np.tile(np.arange(256, dtype=np.uint8), (len(scale_bytes), 1))  # [253, 256]: 512 inputs per row
    scales = np.repeat(scale_bytes[:, None], 512 // 32, axis=1)
    got = jax.jit(pallas_triton._decode_mxfp4, static_argnums=2)(jnp.asarray(packed), jnp.asarray(scales), dtype)
    assert got.dtype == dtype
    assert_same_bits(got, np_decode(packed, scales))


def test_tile_plan_covers_each_row_once_and_skips_empty_groups():
    rows, m = 16, 100
    sizes = np.array([0, 17, 0, 0, 33, 1, 0, 16])  # 67 rows, 33 rows of padding
    group, first, end = (np.asarray(a) for a in pallas_triton._tile_plan(jnp.asarray(sizes, jnp.int32), m, rows))
    assert len(group) == -(-m // rows) + E + 1  # the static worst case
    real = end > first
    assert real.sum() == sum(-(-s // rows) for s in sizes) + -(-33 // rows)  # no tile for an empty group
    owner = np.full(m, -1)
    for g, a, b in zip(group[real], first[real], end[real]):
        assert b - a <= rows and (owner[a:b] == -1).all()
        owner[a:b] = g
    np.testing.assert_array_equal(owner, np.append(np.repeat(np.arange(E), sizes), [E] * 33))  # E: padding


def test_bad_arguments_name_the_problem():
    rng = np.random.default_rng(0)
    odd = jnp.asarray(rng.standard_normal((E, 48, 80)), jnp.float32)  # D = 80 is not a multiple of 32
    with pytest.raises(ValueError, match=r"D \(expert input width\) to be a multiple of 32, got 80"):
        expert_ffn(jnp.zeros((4, 80)), jnp.zeros((E,), jnp.int32), odd, odd, jnp.swapaxes(odd, 1, 2),
                   activation=SILU, impl="pallas")
    ws = weights("plain")
    with pytest.raises(ValueError, match="x must be bf16 or f32 for the Pallas kernels, got float16"):
        pallas_triton.expert_ffn(jnp.zeros((4, D), jnp.float16), jnp.zeros((E,), jnp.int32), *ws, activation=SILU)
    with pytest.raises(ValueError, match="unknown impl 'triton'"):
        expert_ffn(jnp.zeros((4, D)), jnp.zeros((E,), jnp.int32), *ws, activation=SILU, impl="triton")


def test_auto_is_xla_off_gpu():
    assert jax.default_backend() != "gpu"
    ws = weights("plain")
    x = rows_of("f32", 8)
    text = jax.jit(lambda *a: moe_ffn(*a, activation=SILU)).lower(
        x, jnp.zeros((8, 2), jnp.int32), jnp.ones((8, 2)), *ws).as_text()
    assert "pallas" not in text and "triton" not in text


# K3 per device on 16 devices: 56 of 896 experts, D = 3584 (the latent), F = 3072; decode (256
# routed rows) and prefill (4096). Kimi Linear: plain bf16 experts, D = 2304, F = 1024.
K3 = (56, 3072, 3584, "mxfp4", SITU)
KIMI_LINEAR = (32, 1024, 2304, "plain", SILU)


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("shapes, m", [(K3, 256), (K3, 4096), (KIMI_LINEAR, 256)])
def test_lowers_to_triton(platform, shapes, m):
    num_experts, f, d, wkind, activation = shapes
    s = jax.ShapeDtypeStruct

    def weight(out, inp):
        if wkind == "mxfp4":
            return Mxfp4Tensor(s((num_experts, out, inp // 2), jnp.uint8), s((num_experts, out, inp // 32), jnp.uint8))
        return s((num_experts, out, inp), jnp.bfloat16)

    def run(x, sizes, *ws):
        return pallas_triton.expert_ffn(x, sizes, *ws, activation=activation)

    text = lower_for_gpu(run, s((m, d), jnp.bfloat16), s((num_experts,), jnp.int32), weight(f, d), weight(f, d),
                         weight(d, f), platform=platform)
    assert triton_call_count(text) == 2  # gate/up and down
