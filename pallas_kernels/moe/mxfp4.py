"""MXFP4 weights as stored by compressed-tensors ("mxfp4-pack-quantized"), decoded on device.

The layout and constants are `pallas_kernels/mxfp4_format.py`'s.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.mxfp4_format import BYTE_VALUES, GROUP


class Mxfp4Tensor(NamedTuple):
    """A pytree of the packed codes and scale bytes, exactly as stored in the checkpoint."""

    packed: jax.Array  # uint8 [..., out, in / 2]
    scales: jax.Array  # uint8 [..., out, in / 32]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., out, in] shape."""
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])


def dequantize(t: Mxfp4Tensor, dtype=jnp.bfloat16) -> jax.Array:
    """The [..., out, in] weight in `dtype`.

    Every result that is a normal number is exact in fp32 and bf16 (a 2-bit significand times a
    power of two). Results below 2**-126, only possible with scale bytes 0 and 1, are subnormal;
    backends that flush subnormals (XLA:CPU does) return them as zeros of the same sign. Byte 255
    (NaN in E8M0) gives NaN; bytes 253 and 254 overflow to +-inf for the larger codes.
    """
    _check(t)
    shape = t.shape
    # One gather per byte decodes both codes; on XLA:CPU this measured 2-2.5x faster than splitting
    # nibbles into a 16-entry table and as fast as or faster than bitcasting to float4_e2m1fn
    # (0.9-1.3x, on a shared machine).
    values = jnp.asarray(BYTE_VALUES)[t.packed.astype(jnp.int32)]  # [..., out, in/2, 2]
    values = values.reshape(*shape[:-1], shape[-1] // GROUP, GROUP)
    byte = t.scales.astype(jnp.int32)[..., None]
    # 2**(byte - 127) written straight into the fp32 exponent field (255 gets a NaN mantissa bit).
    # Byte 0 would need the subnormal 2**-127, which XLA:CPU reads as 0 in a product, so it is
    # built as 2**-126 with the (exact) code values halved first.
    nan_bit = (byte == 255).astype(jnp.int32) << 22
    scale = jax.lax.bitcast_convert_type((jnp.maximum(byte, 1) << 23) | nan_bit, jnp.float32)
    values = values * jnp.where(byte == 0, 0.5, 1.0).astype(jnp.float32) * scale
    return values.reshape(shape).astype(dtype)


def _check(t: Mxfp4Tensor) -> None:
    packed, scales = t.packed, t.scales
    if packed.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    width = 2 * packed.shape[-1]
    if width % GROUP or tuple(scales.shape) != (*packed.shape[:-1], width // GROUP):
        raise ValueError(f"MXFP4 scales have shape {tuple(scales.shape)} but packed {tuple(packed.shape)} holds "
                         f"{width} inputs per row: expected {GROUP}-input groups, scales "
                         f"{(*packed.shape[:-1], width // GROUP)}")
