"""The Gumbel draw of sampled decoding over K3's 163,840-entry vocabulary, per batch size: the noise
of k3jax.sampling_noise (a keyed triple32 hash, what serve.sampling draws with) against
jax.random.gumbel (threefry2x32, what it drew with before), each vmapped over the rows under the
rows' keys and followed by the sampler's argmax, the whole sampled path of `serve.sampling.sample`
(temperature 1, no filters) and a greedy row's argmax alongside. Interleaved rounds, medians.

    python -m benchmarks.sampling_noise
"""

from __future__ import annotations

import jax
import numpy as np

from benchmarks.report import report
from benchmarks.timing import median_us
from k3jax.sampling_noise import gumbel_noise
from serve import sampling

VOCAB, BATCHES, ROUNDS = 163_840, (1, 4, 16, 64), 9


def threefry_draw(logits, keys):
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], np.float32))(keys)
    return sampling.argmax(logits + gumbel)


def hash_draw(logits, keys):
    return sampling.argmax(logits + jax.vmap(lambda key: gumbel_noise(key, logits.shape[-1]))(keys))


def main() -> None:
    rows = []
    for batch_size in BATCHES:
        logits = jax.random.normal(jax.random.key(0), (batch_size, VOCAB), np.float32)
        params = [sampling.SamplingParams(temperature=1.0, seed=i) for i in range(batch_size)]
        batch = sampling.SamplingBatch.from_params(params, batch_size, num_generated=[3] * batch_size,
                                                   request_ids=list(range(batch_size)))
        keys = sampling.row_keys(batch)
        fns = [jax.jit(threefry_draw), jax.jit(hash_draw),
               jax.jit(lambda logits, keys: sampling.sample(logits, batch, None, None, num_logprobs=None).tokens),
               jax.jit(lambda logits, keys: sampling.argmax(logits))]
        threefry, hashed, sample, greedy = (us / 1e3 for us in median_us(fns, (logits, keys), repeats=ROUNDS))
        rows.append({"batch": batch_size, "threefry_draw_ms": threefry, "hash_draw_ms": hashed,
                     "speedup": threefry / hashed, "sample_ms": sample, "greedy_argmax_ms": greedy})
    report("sampling_noise", rows, note=f"vocabulary {VOCAB}, float32, {ROUNDS} interleaved rounds, medians, "
                                        f"{jax.default_backend()} ({jax.devices()[0].device_kind})")


if __name__ == "__main__":
    main()
