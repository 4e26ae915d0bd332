"""MXFP4 decode/encode against an independent bit-field decoder of the OCP MX E2M1/E8M0 formats."""

import jax.numpy as jnp
import numpy as np
import pytest

from convert import mxfp4
from pallas_kernels.moe import mxfp4 as device_mxfp4


def np_e2m1(code):
    """E2M1 from its bits: sign | 2-bit exponent (bias 1) | 1-bit mantissa; exponent 0 is subnormal."""
    sign = np.where(code & 0b1000, -1.0, 1.0)
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    magnitude = np.where(exponent == 0, mantissa * 0.5, (1 + mantissa / 2) * 2.0 ** (exponent - 1))
    return sign * magnitude


def np_decode(packed, scales):
    """float64 [..., out, in] from packed bytes (low nibble first) and E8M0 bytes."""
    packed = packed.astype(np.int64)
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)
    scale = 2.0 ** (scales.astype(np.float64) - 127)
    return np_e2m1(codes) * np.repeat(scale, 32, axis=-1)


def all_bytes(scale_bytes):
    """Every byte value in every position, with the given scale bytes per 32-value group."""
    packed = np.tile(np.arange(256, dtype=np.uint8), (len(scale_bytes), 1))[:, None, :]  # [S, 1, 256] -> 512 inputs
    scales = np.repeat(np.asarray(scale_bytes, np.uint8)[:, None, None], 16, axis=2)
    return packed, scales


def test_host_decoder_is_exact_for_every_byte_and_scale():
    # up to byte 252: 6 * 2**125 is the largest product that fits float32
    packed, scales = all_bytes([0, 1, 100, 127, 128, 200, 252])
    np.testing.assert_array_equal(mxfp4.dequantize(packed, scales), np_decode(packed, scales))


def test_device_decoder_is_exact():
    # from byte 3: XLA:CPU flushes subnormal results (0.5 * 2**-126 and below) to zero
    packed, scales = all_bytes([3, 100, 127, 128, 200, 252])
    got = device_mxfp4.dequantize(device_mxfp4.Mxfp4Tensor(jnp.asarray(packed), jnp.asarray(scales)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np_decode(packed, scales))
    bf16 = device_mxfp4.dequantize(device_mxfp4.Mxfp4Tensor(jnp.asarray(packed), jnp.asarray(scales)))
    np.testing.assert_array_equal(np.asarray(bf16, np.float64), np_decode(packed, scales))  # exact in bf16


def test_leading_axes_and_shape_errors():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (2, 3, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (2, 3, 4, 1), dtype=np.uint8)
    assert mxfp4.dequantize(packed, scales).shape == (2, 3, 4, 32)
    np.testing.assert_array_equal(mxfp4.dequantize(packed, scales), np_decode(packed, scales))
    with pytest.raises(ValueError, match="scales must be"):
        mxfp4.dequantize(packed, scales[..., :0])
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(packed.astype(np.int32), scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(np.zeros((2, 48)))


def np_round_e2m1(x):
    """Nearest representable E2M1 value, ties to the even code (by brute force over all codes)."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    mag = np.minimum(np.abs(x), 6)
    dist = np.abs(mag[..., None] - grid)
    best = np.isclose(dist, dist.min(-1, keepdims=True), rtol=0, atol=0)
    code = np.where(best.sum(-1) > 1, np.argmax(best & (np.arange(8) % 2 == 0), -1), np.argmin(dist, -1))
    return np.sign(x) * grid[code]


def test_quantize_rounding_saturation_and_zeros():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 64)) * rng.uniform(0.01, 100, (4, 1))
    w[0, :32] = 0.0  # all-zero block
    w[1, :4] = [0.25, 0.75, 2.5, 5.0]  # exact ties once scaled below
    w[1, 4:32] = 0.0
    w[1, 31] = 6.0  # amax 6 -> scale 1, ties stay ties
    packed, scales = mxfp4.quantize(w)
    blocks = w.reshape(4, 2, 32)
    amax = np.abs(blocks).max(-1)
    expo = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, 0)
    np.testing.assert_array_equal(scales, expo + 127)
    want = np_round_e2m1(blocks / 2.0 ** expo[..., None]) * 2.0 ** expo[..., None]
    np.testing.assert_array_equal(mxfp4.dequantize(packed, scales), want.reshape(4, 64))
    assert (mxfp4.dequantize(packed, scales)[1, :4] == [0.0, 1.0, 2.0, 4.0]).all()  # ties to even
    assert (packed[0, :16] == 0).all() and scales[0, 0] == 127


def test_canonical_blocks_round_trip():
    rng = np.random.default_rng(2)
    packed = rng.integers(0, 256, (5, 16), dtype=np.uint8)
    packed[:, 0] = 0x67  # codes 7 (6.0) and 6 (4.0): the block's max magnitude is 6
    packed = np.where((packed & 0xF) == 8, packed & 0xF0, packed)  # no -0 codes
    packed = np.where((packed >> 4) == 8, packed & 0x0F, packed).astype(np.uint8)
    scales = rng.integers(100, 150, (5, 1), dtype=np.uint8)
    p2, s2 = mxfp4.quantize(mxfp4.dequantize(packed, scales))
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(s2, scales)
