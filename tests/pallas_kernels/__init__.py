"""Tests of pallas_kernels/: every implementation against its reference, Pallas in interpret mode,
and lowering to Triton for an H200 and an MI300."""
