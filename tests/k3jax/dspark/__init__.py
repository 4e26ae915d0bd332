"""Tests of the DSpark draft model (k3jax/dspark/): its config, the draft against a NumPy reference,
and loading draft checkpoints."""
