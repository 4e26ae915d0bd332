"""The logprobs of a prompt's own tokens (`echo` with `logprobs` on /v1/completions: how
lm-evaluation-harness's `local-completions` model scores loglikelihoods).

They come from one full forward of the prompt beside the engine's batches (`K3Model.token_logprobs`,
reduced on the devices), not from its prefill steps, which keep only their last position's logits:
a request that asks pays one more forward of its prompt, and gets exactly the full forward's figures,
the ones `python -m k3jax.eval` reports. Prompts are padded to a power of two (at least 16) so that
each length bucket compiles once.
"""

from __future__ import annotations

import numpy as np

from k3jax.model import K3Model
from serve.sampling import logprobs_entry
from sharding.mesh import data_size

SMALLEST_BUCKET = 16


def prompt_entries(model: K3Model, ids: list[int], num_logprobs: int) -> list[dict | None]:
    """One logprobs entry per prompt token ({token: logprob} of it and its num_logprobs most likely
    alternatives), None for the first, which nothing predicts."""
    length = max(SMALLEST_BUCKET, 1 << (len(ids) - 1).bit_length())
    rows = data_size(model.mesh)  # a mesh splits rows over data: one real row and padding rows
    tokens = np.zeros((rows, length), np.int32)
    tokens[0, :len(ids)] = ids
    lengths = np.full(rows, len(ids), np.int32)
    chosen, top_ids, top = model.token_logprobs(tokens, lengths, num_top=max(num_logprobs, 1))
    return [None] + [logprobs_entry(num_logprobs, ids[t], chosen[0, t - 1], top_ids[0, t - 1], top[0, t - 1])
                     for t in range(1, len(ids))]
