"""Tests of DSpark speculative decoding on the serving side: rejection sampling, and speculative engines
and servers against plain ones (the draft model's own tests are tests/k3jax/dspark/)."""
