"""The Gumbel noise of every sampled draw (the serving sampler, speculative rejection sampling, the
DSpark draft's Markov head): one float32 per vocabulary entry from a keyed counter-based hash.

Why not `jax.random.gumbel`: its threefry2x32 runs 20 rounds per pair of words, and vmapped over the
rows of a batch XLA:CPU did not vectorise it: 36 ms for 16 rows of K3's 163,840-entry vocabulary on a
2-core Xeon (2.3 ms a row, a fifth of a batch-16 decode step), where this hash took 4.8 ms, most of
it the two logs (benchmarks/sampling_noise.py). Sampling needs noise that looks independent across
tokens and steps, not a cryptographic stream: entry i of a row with key words (k0, k1) is

    bits = triple32(triple32(i + k0) ^ k1)

with Wellons' triple32, a bijective 32-bit mix of three xor-shift-multiply rounds (among the least
biased such hashes measured by hash-prospector), so a row's entries are distinct words, and keys
come from threefry as before (`serve.sampling.row_keys`), one per row and step. The top 23 bits
give u = (bits >> 9 + 1/2) / 2^23, strictly inside (0, 1), and the noise is -log(-log(u)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# triple32's shifts and odd multipliers (Chris Wellons, hash-prospector).
TRIPLE32 = ((17, 0xED5AD4BB), (11, 0xAC4C1B51), (15, 0x31848BAB), (14, None))


def triple32(x: jax.Array) -> jax.Array:
    """A bijection of uint32 words with full avalanche."""
    for shift, multiplier in TRIPLE32:
        x = x ^ (x >> shift)
        if multiplier is not None:
            x = x * jnp.uint32(multiplier)
    return x


def gumbel_noise(key: jax.Array, size: int) -> jax.Array:
    """float32 [size] standard Gumbel noise under a threefry PRNG key (vmap it over rows)."""
    k0, k1 = jax.random.key_data(key).astype(jnp.uint32)
    bits = triple32(triple32(jnp.arange(size, dtype=jnp.uint32) + k0) ^ k1)
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
    return -jnp.log(-jnp.log(u))
