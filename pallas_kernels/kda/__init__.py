"""Kimi Delta Attention: chunked prefill and recurrent decode (DESIGN.md section 3)."""

from pallas_kernels.kda.api import chunk_kda, fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]
