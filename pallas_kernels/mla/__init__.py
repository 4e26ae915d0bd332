"""MLA attention: naive-form prefill (padded or packed) and absorbed-form decode (contiguous or paged),
ARCHITECTURE.md, "Kernels"."""

from pallas_kernels.mla.api import (
    causal_attention,
    latent_decode_attention,
    paged_decode_attention,
    varlen_causal_attention,
)

__all__ = ["causal_attention", "latent_decode_attention", "paged_decode_attention", "varlen_causal_attention"]
