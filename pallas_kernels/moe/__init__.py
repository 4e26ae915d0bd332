"""MoE expert FFN over MXFP4 (or plain) expert weights (ARCHITECTURE.md, "Kernels")."""

from pallas_kernels.moe.api import expert_ffn, moe_ffn, wants_split_experts
from pallas_kernels.moe.mxfp4 import Mxfp4Tensor, dequantize
from pallas_kernels.moe.split_experts import SPLIT_MIN_BYTES, SplitExperts, split_experts, split_gate_up, stacked

__all__ = ["expert_ffn", "moe_ffn", "wants_split_experts", "Mxfp4Tensor", "dequantize", "SPLIT_MIN_BYTES",
           "SplitExperts", "split_experts", "split_gate_up", "stacked"]
