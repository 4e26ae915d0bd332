"""Token sampling: per-request parameters on the host, one jitted sampler for a whole batch.

`SamplingParams` is what a request asks for (vLLM's names, defaults and ranges). The engine turns
the params of the rows of a batch bucket into a `SamplingBatch` of per-row arrays, so changing a
row's parameters changes array values, never shapes, and `sample` compiles once per (bucket, vocab).

Semantics follow vLLM V1, in its order:
  1. rows that have generated fewer than `min_tokens` tokens may not pick EOS or a stop token id;
     then `logit_bias` is added (clamped to [-100, 100], as vLLM does);
  2. penalties: repetition over prompt and output tokens (positive logits divided, the others
     multiplied), then frequency (times the count) and presence over output tokens;
  3. greedy rows (temperature 0) take the argmax of the penalised logits;
  4. the other rows: temperature, then min-p, top-k and top-p, each on the distribution the previous
     filters left (min-p before top-p matters: it renormalises the mass that top-p cuts), then one
     Gumbel-max draw.
Logprobs are vLLM's default "raw" logprobs: log-softmax of the model's logits, before bans, bias,
penalties, temperature and filters.

No request changes a compiled shape: banned ids travel as a bitmask over the whole vocabulary (any
number of stop token ids, and what a structured output's grammar forbids: `restrict`), logit biases
in a fixed number of columns (at most MAX_LOGIT_BIAS each).

Randomness: a row's key is derived from (request seed, number of tokens generated so far), or for
a request without a seed from (engine seed, request id, tokens generated so far). A request's
tokens therefore do not depend on its row, its batch neighbours or the bucket size, and a request
recomputed after preemption draws the same tokens again. The Gumbel noise under that key comes from
`k3jax.sampling_noise` (a keyed hash: threefry per vocabulary entry was a fifth of a sampled batch-16
step on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.sampling_noise import gumbel_noise
from serve.structured import StructuredOutputsParams

MAX_LOGPROBS = 20
# Temperatures below this are greedy, as in vLLM.
GREEDY_TEMPERATURE = 1e-5
# logit_bias entries one request may have (OpenAI's limit), and the bound vLLM clamps each bias to
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_LIMIT = 100.0
# Largest float32: temperatures and penalties beyond it would be inf in the sampler.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
# Index padding the logit-bias columns: out of bounds for any vocabulary, so the scatter drops it.
_NO_TOKEN = np.iinfo(np.int32).max
_UINT64_MASK = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """A request's sampling parameters (vLLM's names and defaults).

    temperature 0 is greedy. top_k 0 and -1 both mean no top-k. stop and stop_token_ids are stored
    as tuples (a single stop string becomes a 1-tuple, None an empty tuple). max_tokens None means
    up to the context limit. logprobs: None for none, n for the chosen token plus n alternatives.
    ignore_eos only tells the engine not to stop on EOS; min_tokens still bans EOS as in vLLM.
    logit_bias {token id: bias} is stored as sorted (id, bias) pairs, each bias clamped to [-100, 100].
    structured_outputs: the grammar the output must follow (serve/structured.py), enforced by the engine.
    A bad value raises ValueError("<field>: must be ..."), named as the OpenAI API names it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    keep_special_tokens: Sequence[str] = ()  # kept whatever skip_special_tokens says, never spaced: a parser's markers
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def __post_init__(self):
        stop = self.stop
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "keep_special_tokens", tuple(self.keep_special_tokens))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias or ()
        object.__setattr__(self, "logit_bias", tuple(bias))

        def is_int(v):
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_real(v):
            return isinstance(v, numbers.Real) and not isinstance(v, bool)

        checks = (
            ("n", is_int(self.n) and self.n >= 1, "an integer >= 1"),
            ("temperature", is_real(self.temperature) and 0 <= self.temperature <= _FLOAT32_MAX,
             "a finite number >= 0"),
            ("top_p", is_real(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", is_int(self.top_k) and self.top_k >= -1, "-1 or 0 (off) or an integer >= 1"),
            ("min_p", is_real(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("presence_penalty", is_real(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "in [-2, 2]"),
            ("frequency_penalty", is_real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "in [-2, 2]"),
            ("repetition_penalty", is_real(self.repetition_penalty)
             and 0 < self.repetition_penalty <= _FLOAT32_MAX, "a finite number > 0"),
            ("seed", self.seed is None or is_int(self.seed), "None or an integer"),
            ("max_tokens", self.max_tokens is None or is_int(self.max_tokens) and self.max_tokens >= 1,
             "None or an integer >= 1"),
            ("min_tokens", is_int(self.min_tokens) and 0 <= self.min_tokens
             and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
             "an integer in [0, max_tokens]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("stop_token_ids", all(is_int(t) and t >= 0 for t in self.stop_token_ids),
             "integers >= 0"),
            ("logprobs", self.logprobs is None or is_int(self.logprobs)
             and 0 <= self.logprobs <= MAX_LOGPROBS, f"None or an integer in [0, {MAX_LOGPROBS}]"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS
             and all(is_int(t) and t >= 0 and is_real(b) and not math.isnan(b) for t, b in self.logit_bias)
             and len({t for t, _ in self.logit_bias}) == len(self.logit_bias),
             f"at most {MAX_LOGIT_BIAS} {{token id: bias}} entries"),
            ("structured_outputs", self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams), "None or a StructuredOutputsParams"),
        )
        for field, ok, rule in checks:
            if not ok:
                value = getattr(self, field)
                shown = repr(value) if len(repr(value)) < 80 else repr(value)[:77] + "..."
                raise ValueError(f"{field}: must be {rule}, got {shown}")
        object.__setattr__(self, "logit_bias", tuple(sorted(
            (t, min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(b)))) for t, b in self.logit_bias)))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _key_words(seed: int) -> tuple[int, int]:
    """A seed (any int, taken modulo 2**64) as the two uint32 words of a threefry key."""
    seed &= _UINT64_MASK
    return seed >> 32, seed & 0xFFFFFFFF


# One request of each compiled variant of the samplers (with or without logprobs, and penalties),
# for warm-ups.
VARIANTS = (SamplingParams(), SamplingParams(logprobs=1), SamplingParams(repetition_penalty=1.1),
            SamplingParams(logprobs=1, repetition_penalty=1.1))


class SamplingBatch(NamedTuple):
    """Per-row sampling parameters of one batch bucket ([B] arrays unless noted)."""

    temperature: np.ndarray  # f32; 0 for greedy rows
    top_k: np.ndarray  # int32; 0 for off
    top_p: np.ndarray  # f32
    min_p: np.ndarray  # f32
    presence_penalty: np.ndarray  # f32
    frequency_penalty: np.ndarray  # f32
    repetition_penalty: np.ndarray  # f32
    seed_words: np.ndarray  # uint32 [B, 2]: the request's seed, or the engine's for unseeded rows
    seeded: np.ndarray  # bool
    request_id: np.ndarray  # uint32; picks the stream of an unseeded row
    num_generated: np.ndarray  # int32; output tokens so far (the step of the row's key)
    banned_bits: np.ndarray  # uint32 [B, ceil(V / 32)]: bit t % 32 of word t // 32 bans token t
    bias_ids: np.ndarray  # int32 [B, MAX_LOGIT_BIAS]; padded with an out-of-vocabulary index
    bias: np.ndarray  # f32 [B, MAX_LOGIT_BIAS]

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams | None], bucket_size: int, *,
                    num_generated: Sequence[int], request_ids: Sequence[int],
                    eos_token_ids: Sequence[int] = (), engine_seed: int = 0,
                    vocab_size: int | None = None) -> SamplingBatch:
        """Builds the batch on the host; None rows and rows past len(params) are padding.

        num_generated and request_ids run parallel to params (their padding entries are ignored);
        request ids are integers (e.g. the engine's request counter), used modulo 2**32. With
        `vocab_size` the banned-id bitmask covers the vocabulary, so the batch's shapes depend on
        nothing a request asks for (the engine's case); without, it covers the largest banned id.
        """
        if len(params) > bucket_size:
            raise ValueError(f"{len(params)} rows do not fit a bucket of {bucket_size}")
        pad = bucket_size - len(params)
        rows = list(params) + [None] * pad
        num_generated = list(num_generated) + [0] * pad
        request_ids = list(request_ids) + [0] * pad

        # Greedy and padding rows get temperature 0 (greedy) and neutral filters, so they never make
        # the batch pay for a random draw or a sort.
        def column(value, neutral, dtype):
            return np.array([neutral if p is None or p.greedy else value(p) for p in rows], dtype)

        def penalty(value, neutral):
            return np.array([neutral if p is None else value(p) for p in rows], np.float32)

        banned = [np.array(list(eos_token_ids) + list(p.stop_token_ids) if p is not None and done < p.min_tokens
                           else [], np.int64) for p, done in zip(rows, num_generated)]
        words = -(-vocab_size // 32) if vocab_size else max(1, max(-(-(int(ids.max(initial=-1)) + 1) // 32)
                                                                   for ids in banned))
        banned_bits = np.zeros((bucket_size, words), np.uint32)
        for row, ids in enumerate(banned):
            ids = ids[ids < words * 32]
            np.bitwise_or.at(banned_bits[row], ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
        bias_ids = np.full((bucket_size, MAX_LOGIT_BIAS), _NO_TOKEN, np.int32)
        bias = np.zeros((bucket_size, MAX_LOGIT_BIAS), np.float32)
        for row, p in enumerate(rows):
            if p is not None and p.logit_bias:
                bias_ids[row, :len(p.logit_bias)], bias[row, :len(p.logit_bias)] = zip(*p.logit_bias)

        engine_words = _key_words(engine_seed)
        return cls(
            temperature=column(lambda p: p.temperature, 0.0, np.float32),
            top_k=column(lambda p: max(p.top_k, 0), 0, np.int32),
            top_p=column(lambda p: p.top_p, 1.0, np.float32),
            min_p=column(lambda p: p.min_p, 0.0, np.float32),
            presence_penalty=penalty(lambda p: p.presence_penalty, 0.0),
            frequency_penalty=penalty(lambda p: p.frequency_penalty, 0.0),
            repetition_penalty=penalty(lambda p: p.repetition_penalty, 1.0),
            seed_words=np.array([engine_words if p is None or p.seed is None else _key_words(p.seed)
                                 for p in rows], np.uint32),
            seeded=np.array([p is not None and p.seed is not None for p in rows]),
            request_id=np.array([r & 0xFFFFFFFF for r in request_ids], np.uint32),
            num_generated=np.array(num_generated, np.int32),
            banned_bits=banned_bits,
            bias_ids=bias_ids,
            bias=bias,
        )


def restrict(banned_bits: np.ndarray, allowed_bits: np.ndarray | None) -> np.ndarray:
    """Banned-token bits [B, W] with what allowed_bits [B, W] (a grammar's mask; all ones for free rows)
    does not allow banned too. A row whose grammar allows only banned tokens (its end, EOS, before
    min_tokens) keeps the grammar's mask alone: a row with nothing left would draw token 0."""
    if allowed_bits is None:
        return banned_bits
    merged = banned_bits | ~allowed_bits
    open_rows = (allowed_bits & ~merged).any(axis=1)
    return np.where(open_rows[:, None], merged, ~allowed_bits)


class SampleResult(NamedTuple):
    tokens: jax.Array  # int32 [B]
    # None when the sampler was asked for no logprobs (num_logprobs=None)
    logprob: jax.Array  # f32 [B]: raw logprob of the chosen token
    top_ids: jax.Array  # int32 [B, num_logprobs]: most likely tokens, most likely first
    top_logprobs: jax.Array  # f32 [B, num_logprobs]


def apply_penalties(logits: jax.Array, batch: SamplingBatch, output_counts: jax.Array,
                    prompt_mask: jax.Array) -> jax.Array:
    """vLLM's repetition, frequency and presence penalties on f32 logits [B, V]."""
    output_mask = output_counts > 0
    repetition = jnp.where(prompt_mask | output_mask, batch.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - batch.frequency_penalty[:, None] * output_counts
    return logits - batch.presence_penalty[:, None] * output_mask


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def sample(logits: jax.Array, batch: SamplingBatch, output_counts: jax.Array, prompt_mask: jax.Array,
           *, num_logprobs: int | None = 0) -> SampleResult:
    """Samples one token per row of logits [B, V] (any float dtype; sampled in f32).

    output_counts: int32 [B, V], how often each token was generated (`update_counts`);
    prompt_mask: bool [B, V], the tokens of each prompt (`token_counts(prompt) > 0`); both None when no
    row uses a penalty (their own compile, which skips two [B, V] host-to-device copies).
    num_logprobs is static (each value compiles once): None when no row asks for logprobs (the result's
    logprob fields are then None: no log-softmax over the vocabulary), else one bucket such as
    MAX_LOGPROBS (0: the chosen token's only), and each row keeps the first n it asked for.
    """
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"num_logprobs must be None or in [0, {MAX_LOGPROBS}], got {num_logprobs}")
    logits = logits.astype(jnp.float32)
    penalised = penalised_logits(logits, batch, output_counts, prompt_mask)
    greedy = batch.temperature == 0
    greedy_tokens = argmax(penalised)

    # An all-greedy batch skips the random draw (and any sort) entirely.
    tokens = jax.lax.cond(
        jnp.all(greedy), lambda: greedy_tokens,
        lambda: jnp.where(greedy, greedy_tokens, gumbel_argmax(filtered_logits(penalised, batch), row_keys(batch))))
    if num_logprobs is None:
        return SampleResult(tokens, None, None, None)
    return SampleResult(tokens, *raw_logprobs(logits, tokens, num_logprobs))


def argmax(x: jax.Array) -> jax.Array:
    """int32 index of the largest entry along the last axis, the first of ties (jnp.argmax's choice).
    On CPU as a max and then the first index that equals it: XLA:CPU's argmax, a reduction over
    (value, index) pairs, is not vectorised and took 4.0 ms on [16, 163840] f32 where these two
    passes took 1.8 ms (a row holding NaN gets some index in range, never one past the end)."""
    def two_passes(x):
        peak = jnp.max(x, axis=-1, keepdims=True)
        first = jnp.min(jnp.where(x == peak, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)
        return jnp.minimum(first, x.shape[-1] - 1)

    return jax.lax.platform_dependent(x, cpu=two_passes, default=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))


def raw_logprobs(logits: jax.Array, tokens: jax.Array, num_logprobs: int):
    """Log-softmax of f32 logits [..., V] at tokens [...], and the num_logprobs most likely
    (ids, logprobs [..., num_logprobs]), most likely first."""
    log_normaliser = jax.nn.logsumexp(logits, axis=-1)
    logprob = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0] - log_normaliser
    top_logits, top_ids = jax.lax.top_k(logits, num_logprobs)
    return logprob, top_ids, top_logits - log_normaliser[..., None]


def gumbel_argmax(logits: jax.Array, keys: jax.Array) -> jax.Array:
    """One draw per row from softmax(logits [B, V]), row b with keys[b] (the Gumbel-max trick)."""
    gumbel = jax.vmap(lambda key: gumbel_noise(key, logits.shape[-1]))(keys)
    return argmax(logits + gumbel)


def penalised_logits(logits: jax.Array, batch: SamplingBatch, output_counts: jax.Array,
                     prompt_mask: jax.Array) -> jax.Array:
    """Steps 1-2 on f32 logits [B, V]: banned ids (min_tokens) to -inf, the logit biases added, then
    the penalties (none when output_counts is None)."""
    ids = jnp.arange(logits.shape[-1], dtype=jnp.uint32)
    words = jnp.take(batch.banned_bits, ids >> 5, axis=1, mode="fill", fill_value=0)
    banned = jnp.where(((words >> (ids & 31)) & 1) == 1, -jnp.inf, logits)
    rows = jnp.arange(logits.shape[0])[:, None]
    biased = banned.at[rows, batch.bias_ids].add(batch.bias, mode="drop")
    if output_counts is None:
        return biased
    return apply_penalties(biased, batch, output_counts, prompt_mask)


def filtered_logits(penalised: jax.Array, batch: SamplingBatch) -> jax.Array:
    """Step 4 before the draw: penalised logits / temperature with what min-p, top-k and top-p drop
    set to -inf. softmax of the result is the distribution a random row draws from (greedy rows:
    garbage, never read)."""
    temperature = jnp.where(batch.temperature > 0, batch.temperature, 1.0)
    scaled = penalised / temperature[:, None]
    # min-p keeps p >= min_p * p_max, i.e. logit >= max logit + log(min_p): no softmax needed.
    floor = jnp.max(scaled, axis=-1) + jnp.log(batch.min_p)
    floor = jax.lax.cond(jnp.any((batch.top_k > 0) | (batch.top_p < 1)),
                         lambda: _top_k_top_p_floor(scaled, floor, batch.top_k, batch.top_p), lambda: floor)
    return jnp.where(scaled >= floor[:, None], scaled, -jnp.inf)


def _top_k_top_p_floor(scaled, floor, top_k, top_p):
    """Raises each row's logit floor to what top-k and then top-p keep. Ties at a floor all stay."""
    vocab = scaled.shape[-1]
    # One O(V log V) sort per row: the main cost of sampling, paid only when a row uses top-k/top-p.
    ascending = jnp.sort(scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    floor = jnp.maximum(floor, jnp.take_along_axis(ascending, (vocab - k)[:, None], axis=-1)[:, 0])
    # top-p drops the least likely tokens while the mass they carry stays <= 1 - top_p. Summing
    # from the small end keeps that mass accurate, so top_p = 1 drops nothing with nonzero mass.
    probs = jax.nn.softmax(jnp.where(ascending >= floor[:, None], ascending, -jnp.inf), axis=-1)
    tail_mass = jnp.cumsum(probs, axis=-1)
    num_dropped = jnp.minimum(jnp.sum(tail_mass <= 1 - top_p[:, None], axis=-1), vocab - 1)
    return jnp.maximum(floor, jnp.take_along_axis(ascending, num_dropped[:, None], axis=-1)[:, 0])


def row_keys(batch: SamplingBatch) -> jax.Array:
    """Each row's PRNG key: (request seed, or engine seed and request id) folded with num_generated."""
    def row_key(seed_words, seeded, request_id, num_generated):
        key = jax.random.wrap_key_data(seed_words, impl="threefry2x32")
        request_words = jax.random.key_data(jax.random.fold_in(key, request_id))
        key = jax.random.wrap_key_data(jnp.where(seeded, seed_words, request_words), impl="threefry2x32")
        return jax.random.fold_in(key, num_generated)

    return jax.vmap(row_key)(batch.seed_words, batch.seeded, batch.request_id, batch.num_generated)


def logprobs_entry(n: int | None, token, chosen, top_ids, top) -> dict | None:
    """A token's logprobs as the outputs carry them: its n most likely alternatives and itself."""
    if n is None:
        return None
    entry = {int(t): float(v) for t, v in zip(top_ids[:n], top[:n])}
    entry[int(token)] = float(chosen)
    return entry


@jax.jit
def update_counts(output_counts: jax.Array, tokens: jax.Array, active: jax.Array) -> jax.Array:
    """Adds each active row's new token to output_counts int32 [B, V]."""
    rows = jnp.arange(tokens.shape[0])
    return output_counts.at[rows, tokens].add(active.astype(output_counts.dtype))


@functools.partial(jax.jit, static_argnames=("vocab_size",))
def token_counts(token_ids: jax.Array, vocab_size: int) -> jax.Array:
    """int32 [B, V] counts of token_ids [B, L]; negative ids are padding.

    Gives a prompt mask (`> 0`) and rebuilds output counts for a request readmitted mid-generation.
    """
    rows = jnp.arange(token_ids.shape[0])[:, None]
    ids = jnp.where(token_ids >= 0, token_ids, vocab_size)  # out of bounds: dropped
    return jnp.zeros((token_ids.shape[0], vocab_size), jnp.int32).at[rows, ids].add(1, mode="drop")
