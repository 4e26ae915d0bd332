"""MLA attention: naive-form prefill and absorbed-form decode (DESIGN.md section 3)."""

from pallas_kernels.mla.api import causal_attention, latent_decode_attention

__all__ = ["causal_attention", "latent_decode_attention"]
