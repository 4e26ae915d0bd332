"""MXFP4 weights as stored by compressed-tensors ("mxfp4-pack-quantized"), decoded on device.

[..., out, in] logical weights: `packed` uint8 [..., out, in/2] holds two E2M1 codes per byte along
the input axis (low nibble = even index), `scales` uint8 [..., out, in/32] one E8M0 exponent per 32
inputs (scale = 2**(byte - 127)).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

GROUP = 32
# E2M1 code -> value; the top bit is the sign (code 8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class Mxfp4Tensor(NamedTuple):
    packed: jax.Array  # uint8 [..., out, in / 2]
    scales: jax.Array  # uint8 [..., out, in / 32]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])


def dequantize(t: Mxfp4Tensor, dtype=jnp.bfloat16) -> jax.Array:
    """[..., out, in] in `dtype` (exact in bf16: 2-bit mantissas times powers of two)."""
    packed = t.packed.astype(jnp.int32)
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(t.shape)
    values = jnp.asarray(E2M1_VALUES, jnp.float32)[codes]
    # E8M0 -> 2**(byte - 127) exactly, by placing the byte in an fp32 exponent field (bytes 1..254;
    # 0 would be 2**-127, a subnormal flushed to 0 here; 255 is NaN in OCP MX and never produced).
    scale = jax.lax.bitcast_convert_type(t.scales.astype(jnp.uint32) << 23, jnp.float32)
    values = values.reshape(*t.shape[:-1], t.shape[-1] // GROUP, GROUP) * scale[..., None]
    return values.reshape(t.shape).astype(dtype)
