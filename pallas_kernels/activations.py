"""Gated activations shared by the dense MLP, the shared experts and the routed experts
(ARCHITECTURE.md, "MoE and LatentMoE")."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

KINDS = ("silu", "situ")


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """act(gate, up), computed in fp32. Frozen, so it hashes and can be a static jit argument.

    - "silu" (SwiGLU): silu(gate) * up; beta and linear_beta are not used.
    - "situ": [beta * tanh(gate / beta) * sigmoid(gate)] * [linear_beta * tanh(up / linear_beta)],
      the up branch used raw when linear_beta is None. K3: beta 4, linear_beta 25.
    """

    kind: str
    beta: float | None = None
    linear_beta: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown gated activation {self.kind!r}; expected one of {KINDS}")
        if self.kind == "situ" and self.beta is None:
            raise ValueError("the 'situ' activation needs beta (activation_situ_beta)")

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """float32 result of the same shape; the caller casts it (to bf16 before the down projection)."""
        gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
        if self.kind == "silu":
            return jax.nn.silu(gate) * up
        if self.linear_beta is not None:
            up = self.linear_beta * jnp.tanh(up / self.linear_beta)
        return self.beta * jnp.tanh(gate / self.beta) * jax.nn.sigmoid(gate) * up
