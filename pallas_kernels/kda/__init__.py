"""Kimi Delta Attention: chunked prefill and recurrent decode (ARCHITECTURE.md, "Kernels"), and the
chunked prefill with the sequence split over a mesh axis (sequence_parallel.py)."""

from pallas_kernels.kda.api import chunk_kda, fused_recurrent_kda
from pallas_kernels.kda.sequence_parallel import chunk_kda_sequence_parallel

__all__ = ["chunk_kda", "chunk_kda_sequence_parallel", "fused_recurrent_kda"]
