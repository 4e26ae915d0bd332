"""MoE expert FFN over MXFP4 (or plain) expert weights (ARCHITECTURE.md, "Kernels")."""

from pallas_kernels.moe.api import expert_ffn, moe_ffn
from pallas_kernels.moe.mxfp4 import Mxfp4Tensor, dequantize

__all__ = ["expert_ffn", "moe_ffn", "Mxfp4Tensor", "dequantize"]
