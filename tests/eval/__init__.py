"""Tests of k3jax/eval/ (the batch jobs) and of the quickstart notebook."""
