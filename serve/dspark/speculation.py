"""Speculative decoding inside the engine: verify each decoding request's window, accept, roll the
KDA state back to the accepted prefix, and draft the next window.

A step with a speculator replaces the one-token decode of every decoding request by a window
[last token, drafts...] of at most K+1 tokens (K = num_speculative_tokens):
1. one target forward over the windows (`Runner.verify`): logits of every position, MLA rows written
   for the whole window, the KDA slots left as they were and the window recorded instead;
2. the rejection sampler (serve.dspark.rejection) accepts a prefix of the drafts and samples the
   correction or bonus token, so each request gains accepted + 1 tokens;
3. `Runner.commit` folds exactly the accepted window tokens into each KDA slot (replaying the
   recorded recurrence; the conv window is cut at the last accepted token). MLA rows past the accepted
   prefix need no rollback: they lie beyond every later read and are overwritten by the next window;
4. the speculator sees the target's hidden states of the accepted tokens and drafts again from the
   new last token.
The drafts never change which tokens come out: greedy output equals greedy output without them,
and sampled output follows the target's distribution.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from k3jax.loading import embedded_dir
from serve import sampling
from serve.dspark import rejection
from serve.dspark.speculator import DSparkSpeculator
from serve.runner import bucket, place
from serve.scheduler import Request, Status
from serve.step_sampler import penalty_inputs

SPEC_KEYS = ("method", "model", "num_speculative_tokens", "draft_sample_method")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


class SpecStats:
    """Acceptance counters (vLLM's spec-decode metrics): windows with drafts, drafts proposed,
    drafts accepted, and acceptances per draft position."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def record(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        self.num_drafts += int(np.count_nonzero(num_drafts))
        self.num_draft_tokens += int(num_drafts.sum())
        self.num_accepted_tokens += int(num_accepted.sum())
        for accepted in num_accepted:
            for position in range(int(accepted)):
                self.accepted_per_position[position] += 1

    def as_dict(self) -> dict:
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
            # tokens each window yields: the accepted drafts plus the target's own token
            "spec_mean_accepted_length": 1 + self.num_accepted_tokens / max(self.num_drafts, 1),
            "spec_accepted_per_position": list(self.accepted_per_position),
        }


def parse_config(config: dict | str) -> dict:
    """The `--speculative-config` value (a dict or its JSON), checked; names the bad key."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative_config is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(config).__name__}")
    unknown = sorted(set(config) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; expected some of {list(SPEC_KEYS)}")
    if config.get("method", "dspark") != "dspark":
        raise ValueError(f"speculative_config.method {config['method']!r} is not supported; use 'dspark'")
    if not config.get("model"):
        raise ValueError("speculative_config.model is required: the DSpark draft checkpoint directory")
    k = config.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"speculative_config.num_speculative_tokens must be a positive integer, got {k!r}")
    method = config.get("draft_sample_method", "greedy")
    if method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"speculative_config.draft_sample_method {method!r} is not one of {DRAFT_SAMPLE_METHODS}")
    return {"method": "dspark", "model": draft_dir(config["model"]), "num_speculative_tokens": k,
            "draft_sample_method": method}


def draft_dir(model: str) -> str:
    """A draft checkpoint directory as given, or, when no such directory exists, the draft of that
    name shipped with the package ("k3-tiny-dspark", the embedded k3-tiny's)."""
    if os.path.isdir(model) or not os.path.isdir(embedded_dir(model)):
        return model
    return embedded_dir(model)


def from_config(config: dict | str, model, kv_cache_dtype):
    """The DSpark speculator a `speculative_config` describes (its draft loaded next to the target)."""
    config = parse_config(config)
    return DSparkSpeculator.load(config["model"], model, num_speculative_tokens=config["num_speculative_tokens"],
                                 probabilistic=config["draft_sample_method"] == "probabilistic",
                                 kv_cache_dtype=kv_cache_dtype)


def verify_step(engine, requests) -> list:
    """Verifies the windows of the decoding `requests`, emits each one's accepted tokens and commits
    its KDA state; returns the requests (for their outputs)."""
    spec = engine.speculator
    k = spec.num_speculative_tokens
    # DP attention: the windows run in their groups' rows; logits and taps come back in request order
    positions, num_rows = place([r.group for r in requests], engine.layout.groups, engine.decode_rows)
    for request in requests:  # a window ends before the first draft the request's grammar rejects
        request.drafts = request.drafts[:engine.grammars.valid_drafts(request.id, request.drafts)]
    logits, taps, records = engine.runner.verify(
        [([r.tokens[-1], *r.drafts], r.computed, r.slot, r.pages) for r in requests], num_rows, k + 1, positions)
    drafts = np.zeros((num_rows, k), np.int32)
    num_drafts = np.zeros(num_rows, np.int32)
    slots = np.zeros(num_rows, np.int32)
    for i, request in enumerate(requests):
        drafts[i, :len(request.drafts)] = request.drafts
        num_drafts[i], slots[i] = len(request.drafts), request.slot
    result = _accept(engine, requests, num_rows, logits, drafts, num_drafts)
    num_accepted = np.asarray(result.num_accepted)
    window_tokens = num_accepted + 1  # the last token and the accepted drafts are now in the state
    inside = _snapshots_inside(engine, requests, records, slots, window_tokens, positions)
    engine.runner.commit(records, slots, window_tokens, positions=positions)
    spec.observe([(r, r.computed, 1 + len(r.drafts)) for r in requests], taps, window_tokens)
    tokens = np.asarray(result.tokens)
    engine.stats_counters.record(num_drafts[:len(requests)], num_accepted[:len(requests)])
    entries = _logprobs_entries(requests, result, tokens)
    for i, request in enumerate(requests):
        emitted = int(num_accepted[i]) + 1
        engine.emit([(request, int(t), e) for t, e in zip(tokens[i, :emitted], entries[i][:emitted])])
        request.drafts, request.draft_logits = [], None
        if request.status is not Status.FINISHED:
            request.computed += emitted
            if engine.prefix_cache is not None and (copy := engine.scheduler.register(request)) is not None:
                engine.runner.copy_slot(*copy)
    for request, boundary, slot in inside:
        engine.scheduler.keep_snapshot(request, boundary, slot)
    return list(requests)


def _snapshots_inside(engine, requests, records, slots, window_tokens, positions) -> list:
    """Plain decoding reaches every page boundary, and the prefix cache snapshots the KDA state there
    (Scheduler.register); a window passes boundaries without stopping. For each boundary a window
    passes (not one it ends on: register sees that), the state there is committed from the record
    into a spare slot before the row's own commit: one commit per boundary index, rows without one
    writing the null slot. Returns (request, boundary, slot) each, for Scheduler.keep_snapshot once
    the boundary's page is in the cache."""
    if engine.prefix_cache is None:
        return []
    page = engine.layout.page_size
    boundaries = [range((r.computed // page + 1) * page, r.computed + int(window_tokens[i]), page)
                  for i, r in enumerate(requests)]
    inside = []
    for j in range(max(map(len, boundaries), default=0)):
        targets, accepted = np.zeros_like(slots), np.ones_like(slots)
        for i, request in enumerate(requests):
            if j < len(boundaries[i]) and (slot := engine.allocator.allocate_slot(request.group)) is not None:
                inside.append((request, boundaries[i][j], slot))
                targets[i], accepted[i] = slot, boundaries[i][j] - request.computed
        engine.runner.commit(records, slots, accepted, targets, positions)
    return inside


def _accept(engine, requests, num_rows: int, logits, drafts, num_drafts, compile_only: bool = False):
    """The rejection sampler over the verified windows; with `compile_only`, `logits` describes them
    (a ShapeDtypeStruct) and the sampler is compiled, not run."""
    ready = list(enumerate(requests))
    batch = rejection.window_batch([r.params for r in requests], num_rows, drafts.shape[1] + 1,
                                   num_generated=[len(r.output) for r in requests],
                                   request_ids=[r.arrival for r in requests],
                                   eos_token_ids=sorted(engine.eos_ids), engine_seed=engine.options.seed,
                                   vocab_size=logits.shape[-1])
    # grammar masks along each window's drafts, computed while the device verifies
    allowed = engine.grammars.window_allowed(requests, num_rows, drafts.shape[1] + 1)
    batch = batch._replace(banned_bits=sampling.restrict(batch.banned_bits, allowed))
    counts, prompt_mask = penalty_inputs(ready, num_rows, logits.shape[-1])
    wants_logprobs = any(r.params.logprobs is not None for r in requests)
    draft_logits = _draft_logits(engine, requests, num_rows)
    args = (logits, drafts, draft_logits, num_drafts, batch, counts, prompt_mask)
    num_logprobs = sampling.MAX_LOGPROBS if wants_logprobs else None
    if compile_only:
        return rejection.verify.lower(*args, num_logprobs=num_logprobs).compile()
    return rejection.verify(*args, num_logprobs=num_logprobs)


def _draft_logits(engine, requests, num_rows: int):
    """The drafts' logits of each row (probabilistic drafting): rows of the array the last `propose`
    returned, where every request with drafts got them. Rows without drafts read row 0, never used (of
    zeros when no request has drafts). Always `_window_rows` of a committed array, as warm-up compiles it."""
    spec = engine.speculator
    if not spec.probabilistic:
        return None
    source = next((r.draft_logits[0] for r in requests if r.draft_logits is not None), spec.no_draft_logits)
    index = np.zeros(num_rows, np.int32)
    for i, request in enumerate(requests):
        if request.draft_logits is not None:
            index[i] = request.draft_logits[1]
    return _window_rows(source, index)


@jax.jit
def _window_rows(draft_logits, index):
    """draft_logits [P, K, V] (a propose call's rows) at `index` [num_rows]: each verified row's own."""
    return draft_logits[index]


def _compile_window_rows(engine, num_rows: int) -> None:
    """`_window_rows` for num_rows verified rows from every propose bucket (probabilistic drafting)."""
    spec = engine.speculator
    if spec.probabilistic:
        for rows in engine.decode_rows:
            source = jax.ShapeDtypeStruct((rows, *spec.draft_logits_shape), spec.no_draft_logits.dtype,
                                          sharding=spec.no_draft_logits.sharding)
            _window_rows.lower(source, np.zeros(num_rows, np.int32)).compile()


def _logprobs_entries(requests, result, tokens) -> list[list]:
    if not any(r.params.logprobs is not None for r in requests):
        return [[None] * tokens.shape[1] for _ in requests]
    chosen, top_ids, top = map(np.asarray, (result.logprob, result.top_ids, result.top_logprobs))
    return [[sampling.logprobs_entry(r.params.logprobs, tokens[i, j], chosen[i, j], top_ids[i, j], top[i, j])
             for j in range(tokens.shape[1])] for i, r in enumerate(requests)]


def propose(engine, requests) -> None:
    """Drafts the next window of each running request that is decoding, as long as it has room
    (max_model_len) and use (max_tokens) for drafts, and pages for the window: they are reserved now,
    since the draft writes its block there and the verify step needs them next."""
    spec = engine.speculator
    drafting = []
    for request in requests:
        if request.pending != 1:
            continue
        room = engine.options.max_model_len - len(request.tokens)
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output) - 1)
        k = min(spec.num_speculative_tokens, room)
        if k > 0 and engine.scheduler.reserve(request, 1 + k):
            drafting.append((request, k))
    if not drafting:
        return
    drafts, draft_logits = spec.propose([r for r, _ in drafting], bucket(len(drafting), engine.decode_rows))
    for i, (request, k) in enumerate(drafting):
        request.drafts = drafts[i, :k].tolist()
        request.draft_logits = (draft_logits, i) if draft_logits is not None else None


def warm_verify(engine, num_rows: int) -> None:
    """Compiles the verify, accept and commit steps and the speculator's calls for a decode bucket."""
    spec = engine.speculator
    k = spec.num_speculative_tokens
    logits, taps, records = engine.runner.verify([], num_rows, k + 1)
    drafts, num_drafts = np.zeros((num_rows, k), np.int32), np.zeros(num_rows, np.int32)
    for params in sampling.VARIANTS:
        result = _accept(engine, [Request("warmup", [0], params, -1)], num_rows, logits, drafts, num_drafts)
    engine.runner.commit(records, np.zeros(num_rows, np.int32), np.asarray(result.num_accepted) + 1)
    spec.warmup(num_rows, taps)
    _compile_window_rows(engine, num_rows)


def compile_verify(engine, num_rows: int) -> None:
    """`warm_verify` without running anything (serve/warmup.py's background thread, while the engine serves)."""
    spec = engine.speculator
    k = spec.num_speculative_tokens
    logits, taps, records = engine.runner.compile_verify(num_rows, k + 1)
    drafts, num_drafts = np.zeros((num_rows, k), np.int32), np.zeros(num_rows, np.int32)
    for params in sampling.VARIANTS:
        _accept(engine, [Request("warmup", [0], params, -1)], num_rows, logits, drafts, num_drafts, compile_only=True)
    engine.runner.compile_commit(records, num_rows)
    spec.compile(taps, num_rows)
    _compile_window_rows(engine, num_rows)
