"""The serving engine: requests in, tokens out, one `step()` at a time.

A step asks the scheduler for this step's rows, runs the prefill chunks and the decodes as two
jitted model calls (each bucketed), samples a token for every row that reached the end of its
known tokens, and applies the stop rules. Everything a request holds in the cache is freed the
moment it finishes or is aborted.

A failing request fails alone: `add_request` refuses what a step could not run (ids outside the
vocabulary, top_k past it, empty or too long prompts), and a step that raises anyway is retried
without its culprit: every running request is preempted (it recomputes later, its output unchanged)
and the step's requests rerun one at a time, each alone until it samples a token, so the one that
fails alone finishes with finish_reason "error" and the others go on.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading

import jax
import jax.numpy as jnp

from k3jax.model import K3Model
from serve import multihost, sampling, sequence_parallel_prefill, warmup
from serve.detokenizer import OutputText
from serve.dspark import speculation
from serve.encoder_cache import DEFAULT_BUDGET_BYTES, EncoderCache
from serve.multimodal import MultimodalPrompt
from serve.cache import CacheAllocator, describe, engine_layout, free_cache_bytes, page_bytes, slot_bytes
from serve.disagg.handoff import Handoff, PrefillOnly, Prefilled, check_handoff, pool_specs
from serve.kv_offload import KVOffload
from serve.prefix_cache import PrefixCache
from serve.runner import Runner, bucket, buckets, place
from serve.sampling import SamplingParams
from serve.step_sampler import StepSampler, picked
from serve.structured import Grammars
from serve.scheduler import Request, Scheduler, Status, StepPlan
from serve.sessions import DEFAULT_TTL_S, SessionPins, session_key
from sharding.mesh import data_size

logger = logging.getLogger(__name__)

# fp8: E4M3 pages with a per-layer scale of 1, vLLM's and SGLang's default when a checkpoint has no
# calibrated kv scales (benchmarks/engine_fp8_agreement.py shows where the rows fall in E4M3's range)
KV_CACHE_DTYPES = {"auto": None, "bfloat16": jnp.bfloat16, "float32": jnp.float32, "fp8": jnp.float8_e4m3fn,
                   "fp8_e4m3": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The server flags that shape the engine, in snake case (vLLM's names where they exist)."""

    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int = 256  # the longest prefill chunk one row runs per step
    max_prefill_rows: int = 4  # prefill chunks per step
    block_size: int = 16  # tokens per MLA page
    # One budget for MLA pages and KDA slots, or exactly this many pages (vLLM's override); on a mesh
    # each data group has its own (DP attention: serve/cache.py engine_layout)
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = False
    num_snapshot_slots: int | None = None  # KDA snapshots the prefix cache keeps (default: max_num_seqs)
    # Agent sessions (prompt_cache_key, serve/sessions.py): bytes of cache their pins may hold (default a
    # quarter of the cache's), and how long a pin outlives its request, in seconds
    session_cache_bytes: int | None = None
    session_ttl: float = DEFAULT_TTL_S
    # Host bytes that keep what the prefix cache evicts, restored instead of recomputed (vLLM's
    # --kv-offloading-size; serve/kv_offload.py); 0: off
    kv_offload_bytes: int = 0
    seed: int = 0
    # {"method": "dspark", "model": DIR, "num_speculative_tokens": K, "draft_sample_method": "greedy" |
    # "probabilistic"} (vLLM's keys), or that as a JSON string
    speculative_config: dict | str | None = None
    # A steady decode batch's next step goes to the device before this one's tokens reach the host
    # (vLLM's --async-scheduling; Engine._run_ahead): the host's work between steps overlaps the device's.
    async_scheduling: bool = True
    # Every request's tokens and logprobs independent of what else runs (see Engine): one row bucket
    # and one token bucket, prefill chunks that other requests never shorten.
    batch_invariant: bool = False
    # On a mesh with data > 1, a prompt of at least this many tokens that the prefix cache holds none of is
    # prefilled by every device, its tokens split over data (serve/sequence_parallel_prefill.py); None: never
    sequence_parallel_prefill_tokens: int | None = None
    mm_encoder_cache_bytes: int = DEFAULT_BUDGET_BYTES  # the vision encoder's outputs kept (serve/encoder_cache.py)
    max_num_encoder_input_tokens: int | None = None  # image tokens encoded per step (default max_num_batched_tokens)

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk",
                     "max_prefill_rows", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if (self.session_cache_bytes is not None and self.session_cache_bytes < 0) or self.session_ttl < 0:
            raise ValueError("session_cache_bytes and session_ttl must not be negative")
        if self.kv_offload_bytes < 0 or (self.kv_offload_bytes and not self.enable_prefix_caching):
            raise ValueError("kv_offload_bytes: must not be negative, and needs prefix caching")
        if self.sequence_parallel_prefill_tokens is not None and self.sequence_parallel_prefill_tokens < 2:
            raise ValueError("sequence_parallel_prefill_tokens must be at least 2 (a prompt's last token is "
                             f"decoded as usual), got {self.sequence_parallel_prefill_tokens}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {sorted(KV_CACHE_DTYPES)}")
        if self.batch_invariant and (self.enable_prefix_caching or self.speculative_config is not None):
            # a prefix hit resumes from another request's chunking, a verify window computes its tokens
            # otherwise than decode steps: both would make a request's numbers depend on others
            raise ValueError("batch_invariant: not with prefix caching or speculative decoding")


@dataclasses.dataclass
class RequestOutput:
    """A request's output so far; from `step(deltas=True)`, only what is new since its last output
    (token_ids, logprobs and text; text is held back while a stop string could still cut it)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    # "stop", "length", "abort", "error" (the request failed) or "prefilled" (PrefillOnly); None while running
    finish_reason: str | None
    logprobs: list[dict] | None = None
    text: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's name)
    handoff: Handoff | None = None  # a PrefillOnly request's cache, for a decode engine (serve/disagg)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(self, model: K3Model, options: EngineOptions | None = None, *, tokenizer=None, speculator=None):
        """`speculator`: a drafter object (serve.dspark.speculator) instead of `options.speculative_config`."""
        self.model = model
        self.options = options = options or EngineOptions()
        self.tokenizer = tokenizer
        cfg = model.config
        kv_dtype = KV_CACHE_DTYPES[options.kv_cache_dtype] or model.dtype
        if speculator is None and options.speculative_config is not None:
            speculator = speculation.from_config(options.speculative_config, model, kv_dtype)
        if speculator is not None and options.kv_offload_bytes:  # the draft's own pages would not come back
            raise ValueError("kv_offload_bytes: not with speculative decoding")
        groups = data_size(model.mesh)  # DP attention: one block of the pools per data group (serve/runner.py)
        if options.sequence_parallel_prefill_tokens is not None and (
                groups == 1 or speculator is not None or multihost.spans_processes(model.mesh)):
            # the draft would lack the prompt's context (as for a prefilled prompt); follower processes would
            # have to run the prefill's programs too
            raise ValueError("sequence_parallel_prefill_tokens: needs a mesh with data > 1 in one process, and no "
                             "speculative decoding")
        self.speculator = speculator
        self.stats_counters = speculation.SpecStats(speculator.num_speculative_tokens if speculator else 0)
        kv_bytes = jnp.dtype(kv_dtype).itemsize
        draft_page_bytes = speculator.page_bytes(options.block_size) if speculator else 0
        devices = model.mesh.local_devices if model.mesh is not None else jax.devices()[:1]
        self.layout = engine_layout(cfg, options, jnp.dtype(model.dtype).itemsize, kv_bytes, draft_page_bytes, groups,
                                    free_cache_bytes(devices))
        sizes = dict(page_bytes=page_bytes(cfg, options.block_size, kv_bytes) + draft_page_bytes,
                     slot_bytes=slot_bytes(cfg, jnp.dtype(model.dtype).itemsize))
        logger.info("cache: %s", describe(self.layout, max_model_len=options.max_model_len, **sizes))
        self.prefix_cache = PrefixCache(options.block_size) if options.enable_prefix_caching else None
        self.offload = KVOffload(options.kv_offload_bytes) if options.kv_offload_bytes else None
        self.allocator = CacheAllocator(self.layout, self.prefix_cache, self.offload)
        self.sessions = None if self.prefix_cache is None else SessionPins.for_cache(
            self.prefix_cache, self.layout, options, **sizes)
        # With a vision tower, prefill steps carry the images' embeddings (serve/runner.py)
        self.images = EncoderCache(model.vision, options.mm_encoder_cache_bytes) if model.vision is not None else None
        self.scheduler = Scheduler(self.allocator, max_num_seqs=options.max_num_seqs,
                                   max_num_batched_tokens=options.max_num_batched_tokens,
                                   max_prefill_chunk=min(options.max_prefill_chunk, options.max_num_batched_tokens),
                                   max_prefill_rows=options.max_prefill_rows,
                                   whole_chunks=options.batch_invariant, encoder_cache=self.images,
                                   encoder_budget=options.max_num_encoder_input_tokens
                                   or options.max_num_batched_tokens, sessions=self.sessions)
        self.runner = Runner(model, self.layout, max_model_len=options.max_model_len, kv_cache_dtype=kv_dtype,
                             taps=speculator.taps if speculator else None,
                             embed_width=cfg.hidden_size if self.images is not None else None, offload=self.offload)
        if speculator is not None:
            speculator.bind(self.runner, options.seed)
        self.decode_rows = buckets(options.max_num_seqs, smallest=groups)  # rows split over data: multiples of it
        self.prefill_rows = buckets(options.max_prefill_rows, smallest=groups)
        chunk = self.scheduler.max_prefill_chunk  # a runner takes images in steps of 2 tokens or more:
        self.prefill_tokens = buckets(chunk, smallest=max(min(16, chunk), 1 if self.images is None else 2))
        if options.batch_invariant:  # the largest bucket only: every step runs the same programs
            self.decode_rows, self.prefill_rows, self.prefill_tokens = \
                self.decode_rows[-1:], self.prefill_rows[-1:], self.prefill_tokens[-1:]
        self.eos_ids = {cfg.eos_token_id} if cfg.eos_token_id is not None else set()
        if tokenizer is not None:
            self.eos_ids |= set(tokenizer.eos_token_ids)
        self._texts: dict[str, OutputText] = {}  # detokenized output of running requests (with a tokenizer)
        self.grammars = Grammars(tokenizer, cfg.vocab_size, self.eos_ids)  # of structured-output requests
        self.idle = False  # the last step found nothing to run (every request paused, or none admissible)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._ahead: _Ahead | None = None  # the step `_run_ahead` dispatched, its tokens not yet landed
        self.num_steps_ahead = 0

    # requests

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queues a prompt (token ids, text when the engine has a tokenizer, or a MultimodalPrompt with
        its images); returns its id. With `serve.sessions.SessionParams(prompt_cache_key=...)` the
        request belongs to that agent session: its cached prefix stays pinned for the session's next
        turn (needs prefix caching). Prefill/decode disaggregation (serve/disagg): a `Prefilled` prompt
        starts from a prefill server's cache of all but its last token; with `PrefillOnly` params the
        request ends when its prompt is computed, its cache on the output."""
        params = params or SamplingParams()
        imported = prompt.handoff if isinstance(prompt, Prefilled) else None
        if imported is not None:
            if self.speculator is not None:  # the draft's pages of the prompt would be missing
                raise ValueError("prompt: a prefilled prompt needs an engine without speculative decoding")
            check_handoff(imported, prompt.ids, pool_specs(self.runner.pools), self.layout.page_size)
            prompt = prompt.ids
        prompt, spans, cache_prompt = (prompt.ids, prompt.spans, prompt.cache_ids) \
            if isinstance(prompt, MultimodalPrompt) else (prompt, [], None)
        if spans and self.images is None:
            raise ValueError("prompt: this model has no vision tower; it takes no images")
        ids = self._prompt_ids(prompt)
        vocab = self.model.config.vocab_size
        # What a step would otherwise fail on, for every request in it: checked here, for this one.
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must lie in [0, {vocab})")
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must lie in [0, {vocab})")
        if params.top_k > vocab:
            raise ValueError(f"top_k: must be at most the vocabulary size, {vocab}, got {params.top_k}")
        session = session_key(params)
        if session is not None and (self.sessions is None or not self.sessions.enabled):
            raise ValueError("prompt_cache_key: this server keeps no session prefixes (it needs prefix caching, "
                             "a session TTL, a session cache budget and snapshot slots)")
        if len(ids) + 1 > self.options.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens; max_model_len={self.options.max_model_len} leaves "
                             "no room to generate")
        request_id = request_id if request_id is not None else f"req-{next(self._arrivals)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if imported is None and self._splits_over_data(ids, spans):
            imported = sequence_parallel_prefill.handoff(self.model, ids, self.runner.pools, self.layout.page_size)
        if params.structured_outputs is not None:
            self.grammars.add(request_id, params.structured_outputs)
        request = Request(request_id, ids, params, next(self._arrivals), images=spans, cache_prompt=cache_prompt,
                          session=session, imported=imported)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _splits_over_data(self, ids: list[int], spans) -> bool:
        """Whether a new prompt is prefilled with its tokens split over `data`: long enough, text only,
        and nothing of it in any group's prefix cache (a hit computes less)."""
        threshold = self.options.sequence_parallel_prefill_tokens
        if threshold is None or len(ids) < threshold or spans:
            return False
        cache = self.prefix_cache
        return cache is None or not any(cache.cached_pages(ids, g) for g in range(self.layout.groups))

    def generate(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        """Adds the requests and steps until every one of them is done; their final outputs, in order
        (requests added before run in the same steps)."""
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        wanted, done = set(ids), {}
        while len(done) < len(ids):
            for output in self.step():
                if output.finished and output.request_id in wanted:
                    done[output.request_id] = output
        return [done[i] for i in ids]

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        self._texts.pop(request_id, None)
        self.grammars.drop(request_id)
        if request is not None and request.status is not Status.FINISHED:
            self.scheduler.finish(request, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def pause(self, request_id: str, paused: bool = True) -> None:
        """Leaves a request out of the steps (it keeps its cache) until paused again with False."""
        if (request := self.requests.get(request_id)) is not None:
            request.paused = paused

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def warmup(self, *, background: bool = False, transfers: bool = False, log=None) -> threading.Thread | None:
        """Compiles every step shape the engine can run (padding rows only: the pools' real entries stay
        untouched), so nothing compiles while serving.

        With `background`, only what a first request needs (one decode row, one prefill row of the
        shortest chunk) compiles before this returns; the other shapes (with a speculator, its verify,
        commit and draft programs too) compile on a daemon thread, returned, which lowers and compiles
        them without running a step, so the engine may serve meanwhile (a request that needs a shape not
        compiled yet compiles it in its step). The pools' gathers and scatters compile last, for the
        host KV tier or with `transfers` (an engine that reads or writes PD handoffs, serve/disagg).
        `log(done, total)` reports progress."""
        return warmup.warmup(self, background=background, transfers=transfers, log=log)

    def reset_prefix_cache(self) -> None:
        """Drops every cached page and snapshot no running request uses, sessions' pins included."""
        if self.prefix_cache is not None:
            self.sessions.release_all()
            self.allocator.reset_prefix_cache()

    def stats(self) -> dict:
        """Counters: preemptions, prompt tokens computed, prefix-cache hit rate, session pins and the
        host tier's entries, and the speculative acceptance figures."""
        stats = {"num_preemptions": self.scheduler.num_preemptions, "num_steps_ahead": self.num_steps_ahead,
                 "num_computed_prompt_tokens": self.scheduler.num_computed_prompt_tokens}
        if self.prefix_cache is not None:
            stats.update(prefix_cache_hit_rate=self.prefix_cache.hit_rate, session_pins=len(self.sessions.pins),
                         session_pinned_pages=self.sessions.pinned_pages, session_pinned_bytes=self.sessions.nbytes)
        if self.offload is not None:
            stats.update(self.offload.stats())
        if self.speculator is not None:
            stats.update(self.stats_counters.as_dict())
        if self.images is not None:
            stats.update(encoder_cache_hits=self.images.hits, encoder_runs=self.images.misses)
        return stats

    # steps

    def step(self, *, deltas: bool = False) -> list[RequestOutput]:
        """Runs one step; returns the requests that got a token or finished (with `deltas`, only what
        each got since its last output: a server's streams need nothing more, and nothing is copied
        twice). A step dispatched ahead by the previous call (`_run_ahead`) is this call's step."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # its rows of requests that stopped since are dead: nothing of them is used
            plan = StepPlan([r for r in ahead.requests if r.status is Status.RUNNING], [])
        else:
            plan = self.scheduler.schedule()
        self.idle = ahead is None and not plan
        try:
            requests = self._land(ahead) if ahead is not None else self._execute(plan)
        except Exception as error:
            self._ahead = None  # a step dispatched on this one's tokens failed with it
            return self._isolate(plan, error, deltas)
        for request in requests:
            request.suspect = False  # it ran a step to a token
        return [self._output(r, deltas) for r in requests]

    def _execute(self, plan) -> list[Request]:
        touched = []
        if plan.prefill:
            rows = [(r.tokens[r.computed:r.computed + n], r) for r, n in plan.prefill]
            positions, num_rows = place([r.group for _, r in rows], self.layout.groups, self.prefill_rows)
            touched += self.emit(picked(*self._launch(rows, positions, num_rows,
                                                      bucket(max(len(t) for t, _ in rows), self.prefill_tokens))))
        if plan.decode and self.speculator is not None:
            touched += speculation.verify_step(self, plan.decode)
        elif plan.decode:
            rows = [(r.tokens[r.computed:], r) for r in plan.decode]
            positions, num_rows = place([r.group for r in plan.decode], self.layout.groups, self.decode_rows)
            result, ready = self._launch(rows, positions, num_rows, 1)
            if not plan.prefill:
                self._ahead = self._run_ahead(plan.decode, positions, num_rows, result)
            touched += self._emit_landed(result, ready)
        requests = list(dict.fromkeys(touched))
        if self.speculator is not None:
            speculation.propose(self, [r for r in requests if r.status is Status.RUNNING])
        return requests

    def _isolate(self, plan, error: Exception, deltas: bool) -> list[RequestOutput]:
        """After a failed step: a request that ran alone is the culprit and fails; otherwise every
        running request is preempted and the step's requests become suspects, which the scheduler
        runs one at a time. Returns the outputs of requests that finished before the failure."""
        in_step = list(dict.fromkeys([*plan.decode, *(r for r, _ in plan.prefill)]))
        if not in_step:
            raise error  # a failure outside any request's step: the caller's to handle
        finished = [r for r in in_step if r.status is Status.FINISHED]
        unfinished = [r for r in in_step if r.status is not Status.FINISHED]
        if len(in_step) == 1:
            logger.error("request %s failed a step it ran alone; it finishes with an error", in_step[0].id,
                         exc_info=error)
            if unfinished:
                self.scheduler.finish(unfinished[0], "error")
            return [self._output(in_step[0], deltas)]
        logger.error("a step of %d requests failed; rerunning them one at a time", len(in_step), exc_info=error)
        for request in list(reversed(self.scheduler.running)):  # each goes to the queue's front: keep the order
            self.scheduler.preempt(request, suspect=request in unfinished)
        return [self._output(r, deltas) for r in finished]

    def emit(self, sampled: list[tuple[Request, int, dict | None]]) -> list[Request]:
        """Appends sampled tokens (with their logprobs entries) and applies the stop rules; tokens that
        follow a stop in the same step (a speculative window's) are dropped. Public: a speculative step
        (serve/dspark/speculation.py) emits its accepted tokens through it."""
        for request, token, logprobs in sampled:
            if request.status is not Status.FINISHED:
                if logprobs is not None:
                    request.logprobs.append(logprobs)
                self._append(request, token)
        return [r for r, _, _ in sampled]

    def _launch(self, rows, positions: list[int], num_rows: int, num_tokens: int):
        """Dispatches the step of `rows` (at `positions` of num_rows: serve.runner.place) and the sampler of
        its ready rows (row, request), which `picked` brings to the host. Returns (the sampler's device
        result or None, the ready rows)."""
        for _, request in rows:  # prefix-cache hits resume from a KDA snapshot, prefilled prompts from their handoff
            if request.restore_from is not None:
                self.runner.copy_slot(request.restore_from, request.slot)
                request.restore_from = None
            if request.imported is not None:
                self.runner.write_state(request.pages, request.slot, request.imported)
                request.imported = None  # a preempted request recomputes its prompt, as any other
        embeds = self.images.step_embeds(rows, positions, num_rows, num_tokens) if self.images is not None else None
        logits, taps = self.runner.run([(new, r.computed, r.slot, r.pages) for new, r in rows], num_rows, num_tokens,
                                       positions=positions, embeds=embeds)
        if self.speculator is not None:  # the draft reads the target's hidden states of these tokens
            self.speculator.observe([(r, r.computed, len(new)) for new, r in rows], taps, positions=positions)
        for new, request in rows:
            request.computed += len(new)
        self._register(r for _, r in rows)
        ready = [(i, r) for i, (_, r) in zip(positions, rows) if r.pending == 0]
        return (self.sampler(ready, num_rows)(logits) if ready else None), ready

    def _register(self, requests) -> None:
        """Caches the requests' newly filled pages (and a KDA snapshot at a prompt's boundary)."""
        if self.prefix_cache is None:
            return
        for request in requests:
            if request.status is Status.RUNNING and (copy := self.scheduler.register(request)) is not None:
                self.runner.copy_slot(*copy)

    # async scheduling: the next decode step goes to the device before this one's tokens reach the host

    def _run_ahead(self, requests: list[Request], positions: list[int], num_rows: int, result) -> _Ahead | None:
        """Dispatches the next decode step of the same requests, in the same rows, fed with the tokens
        `result` samples: still on the device, so the host's work between steps (bringing the tokens
        over, stop rules, detokenizing, building the next step's inputs, and XLA:CPU's inline part of
        a dispatch) overlaps the device's instead of leaving it idle (vLLM's async scheduling). Only
        for a steady decode batch: when anyone waits, pauses, needs a new page the pool lacks, uses
        penalties or a grammar (their counts and masks need the token in flight) or stops by length with
        the token in flight, this returns None and the next step is scheduled as usual. A request that
        the token in flight stops (EOS, a stop string) wastes its row of the step ahead; nothing of it
        is used."""
        if not self._can_run_ahead(requests):
            return None
        if not all(self.scheduler.reserve(r, 1) for r in requests):
            return None
        logits, _ = self.runner.run([([0], r.computed, r.slot, r.pages) for r in requests], num_rows, 1,
                                    positions=positions, device_tokens=result.tokens)
        for request in requests:
            request.computed += 1
        ready = list(zip(positions, requests))
        self.num_steps_ahead += 1
        return _Ahead(requests, positions, num_rows, ready, self.sampler(ready, num_rows, in_flight=1)(logits))

    def _can_run_ahead(self, requests: list[Request]) -> bool:
        scheduler, limit = self.scheduler, self.options.max_model_len
        if not self.options.async_scheduling or self.speculator is not None or self.runner.spans_processes \
                or scheduler.waiting or len(scheduler.running) != len(requests):
            return False
        for r in requests:
            produced = len(r.output) + 1  # once the token in flight lands
            if r.status is not Status.RUNNING or r.paused or r.suspect or r.params.uses_penalties \
                    or r.id in self.grammars or (r.params.max_tokens is not None and produced >= r.params.max_tokens) \
                    or len(r.prompt) + produced >= limit:
                return False
        new_pages = [0] * self.layout.groups
        for r in requests:
            new_pages[r.group] += self.allocator.pages_for(r.computed + 1) - len(r.pages)
        return all(n <= self.allocator.free_pages_in(g) for g, n in enumerate(new_pages))

    def _emit_landed(self, result, ready) -> list[Request]:
        """Emits a step's tokens once they land; then the rows of a step already ahead of it hold their
        tokens up to what they computed, and their filled pages are cached."""
        touched = self.emit(picked(result, ready))
        if self._ahead is not None:
            self._register(self._ahead.requests)
        return touched

    def sampler(self, ready, num_rows: int, in_flight: int = 0) -> StepSampler:
        """The sampler of a step's `ready` (row, request) pairs in `num_rows` rows (serve/warmup.py compiles
        it too). Built after the step's model call is dispatched: grammar masks are computed while it runs."""
        return StepSampler.for_rows(ready, num_rows, vocab_size=self.model.config.vocab_size, eos_ids=self.eos_ids,
                                    seed=self.options.seed, in_flight=in_flight,
                                    allowed=self.grammars.allowed(ready, num_rows))

    def _land(self, ahead: _Ahead) -> list[Request]:
        """The step of a call that found one dispatched ahead: dispatches the next one first (when the
        batch is still steady), then emits this one's tokens for the requests still running."""
        self._ahead = self._run_ahead(ahead.requests, ahead.positions, ahead.num_rows, ahead.result)
        live = [(i, r) for i, r in ahead.ready if r.status is Status.RUNNING]
        return self._emit_landed(ahead.result, live)

    def _append(self, request: Request, token: int) -> None:
        if isinstance(request.params, PrefillOnly):  # its cache is the result, not the token
            request.exported = Handoff(request.computed, *self.runner.read_state(request.pages, request.slot))
            self.scheduler.finish(request, "prefilled")
            return
        request.output.append(token)
        params = request.params
        if not self.grammars.advance(request.id, token):  # never, with the masks applied
            self.scheduler.finish(request, "error")
        elif self.tokenizer is not None and self._text(request).feed(token):
            self.scheduler.finish(request, "stop")  # a stop string
        elif token in self.eos_ids and not params.ignore_eos:
            self.scheduler.finish(request, "stop")
        elif params.stop_token_ids and token in params.stop_token_ids:
            self.scheduler.finish(request, "stop")
        elif (params.max_tokens is not None and len(request.output) >= params.max_tokens) \
                or len(request.tokens) >= self.options.max_model_len:
            self.scheduler.finish(request, "length")

    def _text(self, request: Request) -> OutputText:
        if request.id not in self._texts:
            self._texts[request.id] = OutputText(self.tokenizer, request.params)
        return self._texts[request.id]

    def _output(self, request: Request, delta: bool = False) -> RequestOutput:
        finished = request.status is Status.FINISHED
        text = None
        if self.tokenizer is not None:
            detokenized = self._text(request)
            if finished:
                detokenized.finish()
            text = detokenized.take(finished) if delta else detokenized.text
        if finished:
            self.requests.pop(request.id, None)
            self._texts.pop(request.id, None)
            self.grammars.drop(request.id)
        start = request.num_sent if delta else 0
        request.num_sent = len(request.output)
        logprobs = request.logprobs[start:] if request.params.logprobs is not None else None
        return RequestOutput(request.id, request.prompt, request.output[start:], request.finish_reason, logprobs,
                             text, request.num_cached_tokens, request.exported)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer files: send token ids, not text")
            prompt = self.tokenizer.encode_prompt(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise ValueError(f"prompt: token ids must lie in [0, {vocab})")
        if not ids:  # nothing to compute a first token from: it would wait at the head of the queue forever
            raise ValueError("prompt: must not be empty")
        return ids


@dataclasses.dataclass
class _Ahead:
    """A decode step dispatched before the previous step's tokens reached the host."""

    requests: list[Request]
    positions: list[int]  # each one's row (serve.runner.place)
    num_rows: int  # with the padding rows
    ready: list[tuple[int, Request]]  # (row, request): every row samples
    result: sampling.SampleResult  # on the device
