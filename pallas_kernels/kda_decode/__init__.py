"""One fused KDA decode step over slot-pooled states, and the commit of a verified window (DESIGN.md 3 and 5)."""

from pallas_kernels.kda_decode.api import commit_accepted, kda_decode

__all__ = ["commit_accepted", "kda_decode"]
