"""MXFP4 (OCP MX, E2M1 elements with one E8M0 scale per 32) on the host, in NumPy.

Layout as in compressed-tensors "mxfp4-pack-quantized" checkpoints: a logical [..., out, in] weight
is `packed` uint8 [..., out, in/2] (two codes per byte along `in`, low nibble = even index) and
`scales` uint8 [..., out, in/32] (scale = 2**(byte - 127)).
"""

from __future__ import annotations

import numpy as np

GROUP = 32
_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1 = np.concatenate([_MAGNITUDES, -_MAGNITUDES]).astype(np.float32)  # code -> value (code 8 is -0)
_EMAX = 2  # exponent of the largest E2M1 magnitude (6 = 1.5 * 2**2)


def dequantize(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., out, in] from packed codes [..., out, in/2] and E8M0 bytes [..., out, in/32]."""
    packed, scales = np.asarray(packed), np.asarray(scales)
    if packed.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    width = 2 * packed.shape[-1]
    if width % GROUP or scales.shape != (*packed.shape[:-1], width // GROUP):
        raise ValueError(f"scales has shape {scales.shape}; packed {packed.shape} holds {width} inputs per row, "
                         f"so scales must be {(*packed.shape[:-1], width // GROUP)}")
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], width)
    scale = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    values = _E2M1[codes].reshape(*packed.shape[:-1], width // GROUP, GROUP) * scale[..., None]
    return values.reshape(*packed.shape[:-1], width)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed, scales) of a float [..., out, in] weight, `in` a multiple of 32.

    Rule (OCP MX v1.0): each block of 32 shares the scale 2**(floor(log2(amax)) - 2), so its largest
    magnitude lands in [4, 8); each element is rounded to the nearest E2M1 value with ties to the
    even code, saturating at +-6. An all-zero block gets scale byte 127 (1.0). Exponents are clipped
    to the E8M0 range [-127, 127]. Zero always encodes as +0. Hence quantize(dequantize(p, s))
    returns (p, s) exactly for blocks whose largest code magnitude is 4 or 6 and that hold no -0.
    """
    w = np.asarray(w, np.float32)
    if w.shape[-1] % GROUP:
        raise ValueError(f"the input axis ({w.shape[-1]}) must be a multiple of {GROUP}")
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - _EMAX, 0)
    exponent = np.clip(exponent, -127, 127).astype(np.int32)
    scaled = blocks / np.ldexp(np.float32(1.0), exponent)[..., None]
    codes = _round_e2m1(scaled).reshape(w.shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, (exponent + 127).astype(np.uint8)


def _round_e2m1(x: np.ndarray) -> np.ndarray:
    """Codes of the nearest E2M1 values (ties to the even code, saturating at 6)."""
    mag = np.minimum(np.abs(x), 6.0)
    upper = np.clip(np.searchsorted(_MAGNITUDES, mag, side="left"), 0, 7)  # first magnitude >= mag
    lower = np.maximum(upper - 1, 0)
    d_low, d_up = mag - _MAGNITUDES[lower], _MAGNITUDES[upper] - mag
    code = np.where(d_up < d_low, upper, lower)
    code = np.where((d_up == d_low) & (upper % 2 == 0), upper, code)
    code = np.where(mag == _MAGNITUDES[upper], upper, code)
    negative = (x < 0) & (code > 0)
    return (code + 8 * negative).astype(np.uint8)
