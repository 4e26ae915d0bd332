"""One fused KDA decode step over slot-pooled states, and the commit of a verified window
(ARCHITECTURE.md, "Kernels" and "DSpark draft")."""

from pallas_kernels.kda_decode.api import commit_accepted, kda_decode

__all__ = ["commit_accepted", "kda_decode"]
