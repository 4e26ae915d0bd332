"""MXFP4 on the host, in NumPy only: quantize and dequantize in the layout and with the constants
of `pallas_kernels/mxfp4_format.py` (the format's one definition).
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.mxfp4_format import BYTE_VALUES, E2M1_VALUES, GROUP

_MAGNITUDES = E2M1_VALUES[:8]
_CODE_OF_TWICE = np.zeros(13, np.uint8)  # 2 * magnitude -> code
_CODE_OF_TWICE[(2 * _MAGNITUDES).astype(int)] = np.arange(8)
_EMAX = 2  # exponent of the largest E2M1 binade (4 and 6)


def dequantize(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., out, in] from packed codes uint8 [..., out, in/2] and E8M0 bytes uint8 [..., out, in/32].

    Exact (subnormal results included) wherever the value fits float32; scale bytes 253 and 254
    overflow to +-inf for the larger codes, and byte 255 (NaN in E8M0) gives NaN.
    """
    packed, scales = np.asarray(packed), np.asarray(scales)
    if packed.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if packed.ndim == 0:
        raise ValueError("packed must have an input axis: [..., out, in/2]")
    width = 2 * packed.shape[-1]
    want = (*packed.shape[:-1], width // GROUP)
    if width % GROUP or scales.shape != want:
        raise ValueError(f"scales has shape {scales.shape} but packed {packed.shape} holds {width} inputs per row: "
                         f"expected groups of {GROUP} inputs and scales of shape {want}")
    byte = scales.astype(np.int32)[..., None]
    values = BYTE_VALUES[packed].reshape(*packed.shape[:-1], width // GROUP, GROUP)
    with np.errstate(over="ignore", invalid="ignore"):  # the +-inf / NaN documented above
        scale = np.where(byte == 255, np.float32(np.nan), np.ldexp(np.float32(1.0), byte - 127))
        values = values * scale
    return values.reshape(*packed.shape[:-1], width)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed, scales) of a finite float [..., out, in] weight, `in` a multiple of 32.

    Rule (OCP MX v1.0): each block of 32 shares the scale 2**(floor(log2(amax)) - 2), so its
    largest magnitude lands in [4, 8); the exponent is clipped to the E8M0 range [-127, 127] (values
    of tiny blocks then round to zero, those of huge ones saturate). An all-zero block gets byte
    127 (scale 1). Each element w / scale is rounded to the nearest E2M1 value, ties to the even
    code (IEEE round-to-nearest-even), magnitudes above 6 saturating to 6. The sign is always kept,
    so -0.0 and negatives that round to zero give code 8 (-0), as an IEEE cast to float4_e2m1fn does.

    Round trip: quantize(dequantize(p, s)) == (p, s) for every "canonical" block, that is one whose
    scale byte is at most 252 and whose largest code magnitude is 4 or 6 (a code 6, 7, 14 or 15
    is present; the rule then picks the same exponent), or one holding only codes 0 and 8 with
    scale byte 127. Other blocks come back re-encoded to the canonical form of the same values.
    """
    w = np.asarray(w)
    if w.ndim == 0 or w.shape[-1] % GROUP:
        raise ValueError(f"the input (last) axis must be a multiple of {GROUP}; got shape {w.shape}")
    blocks = w.astype(np.float64).reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    if not np.isfinite(blocks).all():
        raise ValueError("cannot quantize non-finite values (inf or NaN) to MXFP4")
    amax = np.abs(blocks).max(axis=-1)
    exponent = np.frexp(amax)[1] - 1 - _EMAX  # frexp: amax = m * 2**e with m in [0.5, 1), exact
    exponent = np.where(amax > 0, np.clip(exponent, -127, 127), 0)
    scaled = np.ldexp(blocks, -exponent[..., None])  # exact in float64
    mag = np.minimum(np.abs(scaled), 6.0)
    # The E2M1 grid has spacing 0.5 in [0, 2), 1 in [2, 4) and 2 in [4, 6]; rounding mag/step with
    # np.rint (ties to even) is ties-to-even-code, since even multiples are the even codes.
    step = np.where(mag < 2, 0.5, np.where(mag < 4, 1.0, 2.0))
    codes = _CODE_OF_TWICE[(2 * np.rint(mag / step) * step).astype(np.int64)]
    codes = (codes | (np.signbit(scaled) << 3).astype(np.uint8)).reshape(w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8), (exponent + 127).astype(np.uint8)

