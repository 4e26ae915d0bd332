"""MLA attention: naive-form prefill (padded, packed or paged) and absorbed-form decode (contiguous or paged, of
one token or a few), ARCHITECTURE.md, "Kernels"."""

from pallas_kernels.mla.api import (
    causal_attention,
    latent_decode_attention,
    paged_decode_attention,
    paged_extend_attention,
    paged_prefill_attention,
    varlen_causal_attention,
)

__all__ = ["causal_attention", "latent_decode_attention", "paged_decode_attention", "paged_extend_attention",
           "paged_prefill_attention", "varlen_causal_attention"]
