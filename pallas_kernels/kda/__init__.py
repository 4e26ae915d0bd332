"""Kimi Delta Attention: chunked prefill and recurrent decode (ARCHITECTURE.md, "Kernels")."""

from pallas_kernels.kda.api import chunk_kda, fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]
