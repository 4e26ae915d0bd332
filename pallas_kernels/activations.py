"""Gated activations of the dense MLP, shared experts and routed experts (spec section 2.6)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """act(gate, up) in fp32. "silu": silu(gate) * up. "situ": [beta tanh(gate / beta) sigmoid(gate)]
    * [linear_beta tanh(up / linear_beta)] (the up branch raw when linear_beta is None)."""

    kind: str
    beta: float | None = None
    linear_beta: float | None = None

    def __post_init__(self):
        if self.kind not in ("silu", "situ"):
            raise ValueError(f"unknown gated activation {self.kind!r}; expected 'silu' or 'situ'")
        if self.kind == "situ" and self.beta is None:
            raise ValueError("the 'situ' activation needs beta (activation_situ_beta)")

    def __call__(self, gate, up):
        gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
        if self.kind == "silu":
            return jax.nn.silu(gate) * up
        if self.linear_beta is not None:
            up = self.linear_beta * jnp.tanh(up / self.linear_beta)
        return self.beta * jnp.tanh(gate / self.beta) * jax.nn.sigmoid(gate) * up
