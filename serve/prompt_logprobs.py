"""The logprobs of a prompt's own tokens: `echo` with `logprobs` on /v1/completions (how
lm-evaluation-harness's `local-completions` model scores loglikelihoods) and vLLM's
`prompt_logprobs` on both completion endpoints.

They come from one full forward of the prompt beside the engine's batches, reduced on the devices
(the [T, vocab] logits never reach the host), not from its prefill steps, which keep only their last
position's logits: a request that asks pays one more forward of its prompt, and gets exactly the
full forward's figures, the ones `python -m k3jax.eval` reports. Prompts are padded to a power of
two (at least 16) and the top MAX_LOGPROBS alternatives are always taken, so each length bucket
compiles once whatever the number asked for.

The forward is `K3Model.token_logprobs` (which also gives each token's rank, as vLLM reports it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.model import K3Model
from serve.api_outputs import MIN_LOGPROB
from serve.sampling import MAX_LOGPROBS, logprobs_entry

SMALLEST_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """Per prompt position t >= 1 (entry t - 1): the prompt token's logprob and rank, and the
    MAX_LOGPROBS most likely tokens with their logprobs, best first."""

    ids: list[int]
    chosen: np.ndarray  # float32 [T - 1]
    ranks: np.ndarray  # int32 [T - 1]
    top_ids: np.ndarray  # int32 [T - 1, MAX_LOGPROBS]
    top: np.ndarray  # float32 [T - 1, MAX_LOGPROBS]

    def entries(self, num_logprobs: int) -> list[dict | None]:
        """The engine's logprobs entries ({token: logprob} of the token and its num_logprobs best
        alternatives), None for the first token, which nothing predicts: what `echo` puts first."""
        return [None] + [logprobs_entry(num_logprobs, self.ids[t], self.chosen[t - 1], self.top_ids[t - 1],
                                        self.top[t - 1]) for t in range(1, len(self.ids))]

    def vllm(self, num_logprobs: int, tokenizer) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank,
        decoded_token}} holding the prompt token first and its num_logprobs best alternatives (ranks
        1..n); the prompt token appears once when it is among them."""
        out = [None]
        for t in range(1, len(self.ids)):
            entry = {self.ids[t]: _logprob(self.chosen[t - 1], int(self.ranks[t - 1]), self.ids[t], tokenizer)}
            for rank, (token, value) in enumerate(zip(self.top_ids[t - 1, :num_logprobs], self.top[t - 1]), 1):
                entry[int(token)] = _logprob(value, rank, int(token), tokenizer)
            out.append(entry)
        return out


def _logprob(value, rank: int, token: int, tokenizer) -> dict:
    decoded = tokenizer.token_bytes(token).decode("utf-8", errors="replace") if tokenizer is not None else None
    return {"logprob": max(float(value), MIN_LOGPROB), "rank": rank, "decoded_token": decoded}


def prompt_scores(model: K3Model, ids: list[int]) -> PromptScores:
    """One full forward of the prompt `ids`, reduced to its PromptScores (blocking: run it in a thread)."""
    length = max(SMALLEST_BUCKET, 1 << (len(ids) - 1).bit_length())
    tokens = np.zeros((1, length), np.int32)
    tokens[0, :len(ids)] = ids
    out = model.token_logprobs(tokens, [len(ids)], num_top=min(MAX_LOGPROBS, model.config.vocab_size))
    chosen, ranks, top_ids, top = (a[0, :len(ids) - 1] for a in out)
    return PromptScores(list(ids), chosen, ranks, top_ids, top)
