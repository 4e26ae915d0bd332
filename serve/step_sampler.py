"""The sampler of one engine step: its inputs, built on the host from the requests of the rows that
sample (`ready`: (row, request) pairs; the other rows of the [num_rows, vocab] logits are padding),
and its tokens and logprobs entries brought back to the host."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from serve import sampling


@dataclasses.dataclass
class StepSampler:
    """`sampling.sample` with one step's inputs bound: called on the logits, or compiled ahead."""

    batch: sampling.SamplingBatch
    counts: np.ndarray | None
    prompt_mask: np.ndarray | None
    num_logprobs: int | None
    vocab_size: int

    @classmethod
    def for_rows(cls, ready, num_rows: int, *, vocab_size: int, eos_ids, seed: int,
                 in_flight: int = 0, allowed=None) -> StepSampler:
        """`in_flight`: tokens each request has sampled that have not reached its output yet (a step the
        engine runs ahead samples with one in flight): a draw's key and min_tokens count them.
        `allowed`: the rows' grammar masks (serve/structured.py `Grammars.allowed`), or None."""
        params: list = [None] * num_rows
        generated, ids = [0] * num_rows, [0] * num_rows
        for i, request in ready:
            params[i], generated[i], ids[i] = request.params, len(request.output) + in_flight, request.arrival
        batch = sampling.SamplingBatch.from_params(params, num_rows, num_generated=generated, request_ids=ids,
                                                   eos_token_ids=sorted(eos_ids), engine_seed=seed,
                                                   vocab_size=vocab_size)
        batch = batch._replace(banned_bits=sampling.restrict(batch.banned_bits, allowed))
        counts, prompt_mask = penalty_inputs(ready, num_rows, vocab_size)
        wants_logprobs = any(r.params.logprobs is not None for _, r in ready)
        return cls(batch, counts, prompt_mask, sampling.MAX_LOGPROBS if wants_logprobs else None, vocab_size)

    def __call__(self, logits) -> sampling.SampleResult:
        return sampling.sample(logits, self.batch, self.counts, self.prompt_mask, num_logprobs=self.num_logprobs)

    def compile(self, logits: jax.ShapeDtypeStruct) -> None:
        """Compiles the sampler for logits like `logits` (the runner's `compile` says what its step's are:
        their sharding is part of what the compiled sampler is looked up by)."""
        sampling.sample.lower(logits, self.batch, self.counts, self.prompt_mask,
                              num_logprobs=self.num_logprobs).compile()


def penalty_inputs(ready, num_rows: int, vocab: int):
    """Output-token counts and prompt masks [num_rows, vocab] (zero rows for requests without a
    penalty), or (None, None) when no ready request uses one: at K3's 164K vocabulary a batch's
    two arrays are ~5 bytes x rows x 164K, too much to build and copy every step for nothing.
    Built on the host: fine for occasional use (a device-resident per-slot count table would
    avoid the copy)."""
    if not any(r.params.uses_penalties for _, r in ready):
        return None, None
    counts = np.zeros((num_rows, vocab), np.int32)
    prompt_mask = np.zeros((num_rows, vocab), bool)
    for i, request in ready:
        if request.params.uses_penalties:
            np.add.at(counts[i], request.output, 1)
            prompt_mask[i, request.prompt] = True
    return counts, prompt_mask


def picked(result: sampling.SampleResult | None, ready) -> list[tuple[object, int, dict | None]]:
    """(request, token, its logprobs entry or None) per ready row, from the sampler's device result
    (this waits for the step that computes it)."""
    if not ready:
        return []
    tokens = np.asarray(result.tokens)
    entries = [None] * len(ready)
    if any(r.params.logprobs is not None for _, r in ready):
        chosen, top_ids, top = map(np.asarray, (result.logprob, result.top_ids, result.top_logprobs))
        entries = [sampling.logprobs_entry(r.params.logprobs, tokens[i], chosen[i], top_ids[i], top[i])
                   for i, r in ready]
    return [(r, int(tokens[i]), entry) for (i, r), entry in zip(ready, entries)]
