"""The hot ops, one package each (kda, kda_decode, mla, moe): a plain reference, an XLA path and
Pallas-Triton kernels behind one `impl="auto"` function (ARCHITECTURE.md, "Kernels"). Depends on jax
alone and knows nothing of the model. Imports nothing itself, so that `pallas_kernels.mxfp4_format`
stays cheap for the configuration modules to import."""
