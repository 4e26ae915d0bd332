"""Checkpoint formats: reading Hugging Face safetensors (K3, Kimi Linear, DSpark drafts) into the
parameter layout one layer at a time, streaming conversion to Orbax (`python -m convert`), host-side
MXFP4 and synthetic checkpoints (`python -m convert.synth`). Imports only the configuration modules
of k3jax (ARCHITECTURE.md, "Packages and arrows"), so the model's loader can use these readers."""
