"""MXFP4 decode/encode (host NumPy and device jnp) against an independent bit-field decoder of the
OCP MX formats: E2M1 elements (sign | 2 exponent bits, bias 1 | 1 mantissa bit) and E8M0 scales."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from convert import mxfp4
from pallas_kernels.moe import mxfp4 as device_mxfp4

SCALE_BYTES = [0, 1, 2, 3, 100, 126, 127, 128, 200, 252, 253, 254, 255]


def np_e2m1(code):
    """float64 value of a 4-bit E2M1 code from its bit fields; exponent 0 is subnormal (0 or 0.5)."""
    sign = np.where(code & 0b1000, -1.0, 1.0)
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    magnitude = np.where(exponent == 0, mantissa * 0.5, (1 + mantissa / 2) * 2.0 ** (exponent - 1))
    return sign * magnitude


def np_e8m0(byte):
    """float64 2**(byte - 127); 255 is NaN."""
    return np.where(byte == 255, np.nan, 2.0 ** (byte.astype(np.float64) - 127))


def np_decode(packed, scales):
    """float64 [..., out, in] from packed bytes (low nibble = even input) and one E8M0 byte per 32 inputs."""
    packed = packed.astype(np.int64)
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)
    return np_e2m1(codes) * np.repeat(np_e8m0(scales), 32, axis=-1)


def assert_same_bits(got, want, *, flushed_subnormals_ok=False):
    """got equals want (float64, rounded here to got's dtype) bit for bit, signed zeros included; NaN
    anywhere NaN is wanted. flushed_subnormals_ok: a wanted subnormal may come back as a zero of its
    sign (backends that flush subnormals, XLA:CPU among them)."""
    got = np.asarray(got)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    with np.errstate(over="ignore"):  # values past the dtype's range are wanted as +-inf
        want = np.where(nan, 0, want).astype(got.dtype)
    got = np.where(nan, 0, got).astype(got.dtype)
    bits = np.uint32 if got.dtype == np.float32 else np.uint16
    ok = got.view(bits) == want.view(bits)
    if flushed_subnormals_ok:
        subnormal = (want != 0) & (np.abs(want.astype(np.float64)) < 2.0 ** -126)
        ok |= subnormal & (got == 0) & (np.signbit(got) == np.signbit(want))
    assert ok.all(), f"{(~ok).sum()} mismatches, first at {np.argwhere(~ok)[0]}: {got[~ok][:4]} vs {want[~ok][:4]}"


def every_byte_with(scale_bytes):
    """packed [S, 1, 256]: every byte value (512 inputs, 16 groups) per row; row s uses scale_bytes[s]."""
    packed = np.tile(np.arange(256, dtype=np.uint8), (len(scale_bytes), 1))[:, None, :]
    scales = np.repeat(np.asarray(scale_bytes, np.uint8)[:, None, None], 16, axis=2)
    return packed, scales


def device_dequantize(packed, scales, dtype):
    return jax.jit(device_mxfp4.dequantize, static_argnums=1)(
        device_mxfp4.Mxfp4Tensor(jnp.asarray(packed), jnp.asarray(scales)), dtype)


def test_host_decoder_is_exact_for_every_byte_and_scale():
    packed, scales = every_byte_with(SCALE_BYTES)
    got = mxfp4.dequantize(packed, scales)
    assert got.dtype == np.float32 and got.shape == (len(SCALE_BYTES), 1, 512)
    assert_same_bits(got, np_decode(packed, scales))  # subnormals too; 253/254 overflow to inf


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_device_decoder_is_exact_for_every_byte_and_scale(dtype):
    packed, scales = every_byte_with(SCALE_BYTES)
    got = device_dequantize(packed, scales, dtype)
    assert got.dtype == dtype
    assert_same_bits(got, np_decode(packed, scales), flushed_subnormals_ok=True)


def test_leading_axes_and_mixed_scales():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (2, 3, 4, 32), dtype=np.uint8)
    scales = rng.integers(0, 256, (2, 3, 4, 2), dtype=np.uint8)
    want = np_decode(packed, scales)
    assert_same_bits(mxfp4.dequantize(packed, scales), want)
    tensor = device_mxfp4.Mxfp4Tensor(jnp.asarray(packed), jnp.asarray(scales))
    assert tensor.shape == (2, 3, 4, 64)
    assert_same_bits(device_dequantize(packed, scales, jnp.float32), want, flushed_subnormals_ok=True)


def test_shape_and_dtype_errors_name_the_problem():
    packed, scales = np.zeros((4, 16), np.uint8), np.zeros((4, 1), np.uint8)
    with pytest.raises(ValueError, match=r"scales has shape \(4, 2\).*\(4, 1\)"):
        mxfp4.dequantize(packed, np.zeros((4, 2), np.uint8))
    with pytest.raises(ValueError, match="groups of 32"):
        mxfp4.dequantize(packed[:, :8], scales)
    with pytest.raises(ValueError, match="must be uint8, got int32"):
        mxfp4.dequantize(packed.astype(np.int32), scales)
    with pytest.raises(ValueError, match="multiple of 32; got shape"):
        mxfp4.quantize(np.zeros((2, 48)))
    with pytest.raises(ValueError, match="non-finite"):
        mxfp4.quantize(np.full((1, 32), np.inf))
    with pytest.raises(ValueError, match=r"MXFP4 scales have shape \(4, 3\)"):
        device_mxfp4.dequantize(device_mxfp4.Mxfp4Tensor(jnp.asarray(packed), jnp.zeros((4, 3), jnp.uint8)))
    with pytest.raises(ValueError, match="must be uint8"):
        device_mxfp4.dequantize(device_mxfp4.Mxfp4Tensor(jnp.asarray(packed, jnp.int8), jnp.asarray(scales)))


GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1 magnitudes of codes 0..7


def np_reference_quantize(w):
    """(codes, scale bytes) by brute force: OCP scale 2**(floor(log2(amax)) - 2) clipped to E8M0
    (byte 127 for all-zero blocks), then the nearest magnitude over all 8 codes, ties to the even
    code, above 6 saturating to 6, the sign bit copied from the input (also for zeros)."""
    blocks = np.asarray(w, np.float64).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        exponent = np.clip(np.floor(np.log2(amax)) - 2, -127, 127)
    exponent = np.where(amax > 0, exponent, 0)
    scaled = np.abs(blocks) / 2.0 ** exponent[..., None]
    dist = np.abs(np.minimum(scaled, 6)[..., None] - GRID)
    nearest = dist == dist.min(-1, keepdims=True)
    code = np.argmax(nearest & (np.arange(8) % 2 == 0), -1)  # an even code if it is among the nearest
    code = np.where(nearest.sum(-1) == 1, np.argmax(nearest, -1), code)
    code = code + 8 * np.signbit(blocks)
    return code.reshape(w.shape), (exponent + 127).astype(np.uint8)


def unpack(packed):
    return np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)


def test_quantize_matches_reference_rounding():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((6, 128)) * rng.uniform(1e-3, 1e3, (6, 1))).astype(np.float32)
    w[0, :32] = 0.0  # all-zero block -> byte 127
    w[0, 32:64] = -0.0
    # amax 7 -> scale 1: ties 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4;
    # 6.5 and 7 saturate to 6; -0.0 and -0.2 keep their sign as -0.
    w[1, :32] = 0.0
    w[1, :12] = [0.25, -0.75, 1.25, -1.75, 2.5, 3.5, -5.0, 6.5, 7.0, -0.0, -0.2, 0.1]
    w[2, :32] = np.float32(2.0) ** -135 * np.arange(1, 33)  # exponent -132 clipped to -127 (byte 0)
    w[3, :32] = rng.uniform(-1, 1, 32) * 2.0 ** 127
    w[3, 5] = 3e38  # the largest float32 binade -> byte 252
    packed, scales = mxfp4.quantize(w)
    codes, want_scales = np_reference_quantize(w)
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(unpack(packed), codes)
    assert scales[0, 0] == 127 and scales[2, 0] == 0 and scales[3, 0] == 252
    np.testing.assert_array_equal(unpack(packed)[0, :64], [0] * 32 + [8] * 32)
    np.testing.assert_array_equal(np_e2m1(unpack(packed)[1, :12]), [0, -1, 1, -2, 2, 4, -4, 6, 6, 0, 0, 0])
    np.testing.assert_array_equal(unpack(packed)[1, 9:12], [8, 8, 0])  # -0, -0, +0
    # and as values: dequantize(quantize(w)) is the reference rounding times the scale
    want = np_e2m1(codes) * np.repeat(np_e8m0(want_scales), 32, -1)
    assert_same_bits(mxfp4.dequantize(packed, scales), want)


def test_quantize_accepts_bf16_and_leading_axes():
    w = np.random.default_rng(3).standard_normal((2, 3, 64)).astype(ml_dtypes.bfloat16)
    packed, scales = mxfp4.quantize(w)
    assert packed.shape == (2, 3, 32) and scales.shape == (2, 3, 2)
    codes, want_scales = np_reference_quantize(w.astype(np.float64))
    np.testing.assert_array_equal(unpack(packed), codes)
    np.testing.assert_array_equal(scales, want_scales)


def canonical_blocks(rng, rows):
    """Random packed rows (2 blocks each) made canonical: a code of magnitude 4 or 6 in every block,
    scale bytes 0..252; -0 codes included. Row 0's first block is all +-0 with byte 127."""
    packed = rng.integers(0, 256, (rows, 32), dtype=np.uint8)
    packed[:, [0, 16]] = rng.choice([0x06, 0x7E, 0xF8, 0x8F], (rows, 2))
    scales = rng.integers(0, 253, (rows, 2), dtype=np.uint8)
    packed[0, :16] = rng.choice([0x00, 0x08, 0x80, 0x88], 16)
    scales[0, 0] = 127
    return packed, scales


def test_canonical_blocks_round_trip_exactly():
    packed, scales = canonical_blocks(np.random.default_rng(2), 64)
    p2, s2 = mxfp4.quantize(mxfp4.dequantize(packed, scales))
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(s2, scales)


def test_other_blocks_reencode_to_the_same_values():
    rng = np.random.default_rng(4)
    packed = rng.integers(0, 256, (64, 32), dtype=np.uint8) & 0xBB  # magnitudes <= 1.5: not canonical
    scales = rng.integers(0, 253, (64, 2), dtype=np.uint8)
    values = mxfp4.dequantize(packed, scales)
    p2, s2 = mxfp4.quantize(values)
    assert (s2 != scales).any()
    assert_same_bits(mxfp4.dequantize(p2, s2), values.astype(np.float64))
