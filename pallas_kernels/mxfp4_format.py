"""The MXFP4 weight format, defined once: the numbers every reader and decoder of it shares.

compressed-tensors "mxfp4-pack-quantized" (OCP MX: E2M1 elements sharing one E8M0 scale per 32)
stores a logical [..., out, in] weight as `packed` uint8 [..., out, in/2], two E2M1 codes per byte
along the input axis (low nibble = even input index, high nibble = odd), and `scales` uint8
[..., out, in/32], one exponent byte per 32 consecutive inputs (scale = 2**(byte - 127)). E2M1
codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 the same with the sign bit set (8 is -0).

NumPy only, and `pallas_kernels/__init__.py` imports nothing, so the configuration modules and the
host-side converter (`convert/mxfp4.py`) read these without importing jax; the device decode is
`pallas_kernels/moe/mxfp4.py`.
"""

from __future__ import annotations

import numpy as np

GROUP = 32  # inputs per E8M0 scale byte
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)  # code -> value
# byte -> (value of the low nibble, value of the high nibble): one gather per byte decodes both codes.
BYTE_VALUES = np.stack([E2M1_VALUES[np.arange(256) & 0xF], E2M1_VALUES[np.arange(256) >> 4]], axis=-1)


def random_scale_byte(fan_in: int) -> int:
    """The E8M0 byte that gives uniformly random E2M1 codes (RMS ~2.93) a fan-in scaled std, for
    synthetic and randomly initialised MXFP4 weights."""
    rms = float(np.sqrt(np.mean(E2M1_VALUES ** 2)))
    return 127 + int(round(np.log2(fan_in ** -0.5 / rms)))
