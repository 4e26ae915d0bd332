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
import numpy as np

from k3jax.model import K3Model
from serve import sampling
from serve.dspark import speculation
from serve.cache import CacheAllocator, CacheLayout, page_bytes
from serve.prefix_cache import PrefixCache
from serve.runner import Runner, bucket, buckets
from serve.sampling import SamplingParams
from serve.scheduler import Request, Scheduler, Status

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
    kv_cache_memory_bytes: int | None = None  # one budget for MLA pages and KDA slots
    num_gpu_blocks: int | None = None  # or: exactly this many pages (vLLM's override)
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = False
    num_snapshot_slots: int | None = None  # KDA snapshots the prefix cache keeps (default: max_num_seqs)
    seed: int = 0
    # {"method": "dspark", "model": DIR, "num_speculative_tokens": K, "draft_sample_method": "greedy" |
    # "probabilistic"} (vLLM's keys), or that as a JSON string
    speculative_config: dict | str | None = None
    # Every request's tokens and logprobs independent of what else runs (see Engine): one row bucket
    # and one token bucket, prefill chunks that other requests never shorten.
    batch_invariant: bool = False

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk",
                     "max_prefill_rows", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
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
    finish_reason: str | None  # "stop", "length", "abort" or "error" (the request failed); None while running
    logprobs: list[dict] | None = None
    text: str | None = None

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
        self.speculator = speculator
        self.stats_counters = speculation.SpecStats(speculator.num_speculative_tokens if speculator else 0)
        self.layout = self._layout(cfg, options, jnp.dtype(model.dtype).itemsize, jnp.dtype(kv_dtype).itemsize,
                                   speculator.page_bytes(options.block_size) if speculator else 0)
        self.prefix_cache = PrefixCache(options.block_size) if options.enable_prefix_caching else None
        self.allocator = CacheAllocator(self.layout, self.prefix_cache)
        self.scheduler = Scheduler(self.allocator, max_num_seqs=options.max_num_seqs,
                                   max_num_batched_tokens=options.max_num_batched_tokens,
                                   max_prefill_chunk=min(options.max_prefill_chunk, options.max_num_batched_tokens),
                                   max_prefill_rows=options.max_prefill_rows,
                                   whole_chunks=options.batch_invariant)
        self.runner = Runner(model, self.layout, max_model_len=options.max_model_len, kv_cache_dtype=kv_dtype,
                             taps=speculator.taps if speculator else None)
        if speculator is not None:
            speculator.bind(self.runner, options.seed)
        self.decode_rows = buckets(options.max_num_seqs, smallest=self.runner.num_data)
        self.prefill_rows = buckets(options.max_prefill_rows, smallest=self.runner.num_data)
        self.prefill_tokens = buckets(self.scheduler.max_prefill_chunk, smallest=min(16, self.scheduler.max_prefill_chunk))
        if options.batch_invariant:  # the largest bucket only: every step runs the same programs
            self.decode_rows, self.prefill_rows, self.prefill_tokens = \
                self.decode_rows[-1:], self.prefill_rows[-1:], self.prefill_tokens[-1:]
        self.eos_ids = {cfg.eos_token_id} if cfg.eos_token_id is not None else set()
        if tokenizer is not None:
            self.eos_ids |= set(tokenizer.eos_token_ids)
        self._texts: dict[str, _Text] = {}  # detokenized output of running requests (with a tokenizer)
        self.idle = False  # the last step found nothing to run (every request paused, or none admissible)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()

    @staticmethod
    def _layout(cfg, options: EngineOptions, dtype_bytes: int, kv_bytes: int, draft_page_bytes: int) -> CacheLayout:
        snapshots = 0
        if options.enable_prefix_caching:
            snapshots = options.max_num_seqs if options.num_snapshot_slots is None else options.num_snapshot_slots
        slots = options.max_num_seqs + snapshots + 1
        min_pages = -(-options.max_model_len // options.block_size) + 1  # one full-length request, and the null page
        if options.num_gpu_blocks is not None:
            pages = options.num_gpu_blocks
        elif options.kv_cache_memory_bytes is not None:
            pages = CacheLayout.from_budget(cfg, memory_bytes=options.kv_cache_memory_bytes,
                                            max_num_seqs=slots - 1, page_size=options.block_size,
                                            dtype_bytes=dtype_bytes, kv_cache_dtype_bytes=kv_bytes,
                                            draft_page_bytes=draft_page_bytes).num_pages
        else:  # every slot can hold a full-length request
            pages = options.max_num_seqs * (min_pages - 1) + 1
        if pages < min_pages:
            raise ValueError(f"{pages} pages of {options.block_size} tokens "
                             f"({pages * (page_bytes(cfg, options.block_size, kv_bytes) + draft_page_bytes)} bytes) "
                             "cannot hold one "
                             f"request of max_model_len={options.max_model_len}; raise the cache budget")
        return CacheLayout(options.block_size, pages, slots)

    # requests

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queues a prompt (token ids, or text when the engine has a tokenizer); returns its id."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt)
        vocab = self.model.config.vocab_size
        # What a step would otherwise fail on, for every request in it: checked here, for this one.
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must lie in [0, {vocab})")
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must lie in [0, {vocab})")
        if params.top_k > vocab:
            raise ValueError(f"top_k: must be at most the vocabulary size, {vocab}, got {params.top_k}")
        if len(ids) + 1 > self.options.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens; max_model_len={self.options.max_model_len} leaves "
                             "no room to generate")
        request_id = request_id if request_id is not None else f"req-{next(self._arrivals)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, ids, params, next(self._arrivals))
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

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

    def warmup(self, *, background: bool = False, log=None) -> threading.Thread | None:
        """Compiles every step shape the engine can run (padding rows only: the pools' real entries stay
        untouched), so nothing compiles while serving.

        With `background`, only what a first request needs (one decode row, one prefill row of the
        shortest chunk) compiles before this returns; the other shapes of a plain engine compile on a
        daemon thread, returned, which lowers and compiles them without running a step, so the engine
        may serve meanwhile (a request that needs a shape not compiled yet compiles it in its step).
        A speculative engine always warms in full. `log(done, total)` reports progress."""
        shapes = [(rows, 1) for rows in self.decode_rows]
        shapes += [(rows, tokens) for rows in self.prefill_rows for tokens in self.prefill_tokens]
        first = [(self.decode_rows[0], 1), (self.prefill_rows[0], self.prefill_tokens[0])]
        now = first if background and self.speculator is None else shapes
        if self.prefix_cache is not None:
            self.runner.copy_slot(0, 0)
        for done, (num_rows, num_tokens) in enumerate(now, 1):
            if num_tokens == 1 and self.speculator is not None:
                speculation.warm_verify(self, num_rows)
            else:
                self._warm(num_rows, num_tokens)
            if log is not None:
                log(done, len(shapes))
        rest = [shape for shape in shapes if shape not in now]
        if not rest:
            return None
        thread = threading.Thread(target=self._compile_ahead, args=(rest, len(now), len(shapes), log),
                                  name="compile-ahead", daemon=True)
        thread.start()
        return thread

    def _compile_ahead(self, shapes, done: int, total: int, log) -> None:
        samplers = {rows for rows, _ in shapes} - {self.decode_rows[0], self.prefill_rows[0]}
        for num_rows, num_tokens in shapes:
            self.runner.compile(num_rows, num_tokens)
            if num_rows in samplers:
                samplers.discard(num_rows)
                for params in sampling.VARIANTS:
                    self._sampler_inputs([(0, Request("warmup", [0], params, -1))], num_rows).compile()
            done += 1
            if log is not None:
                log(done, total)

    def reset_prefix_cache(self) -> None:
        """Drops every cached page and snapshot no running request uses."""
        if self.prefix_cache is not None:
            self.allocator.reset_prefix_cache()

    def stats(self) -> dict:
        """Counters: preemptions, prefix-cache hit rate, and the speculative acceptance figures."""
        stats = {"num_preemptions": self.scheduler.num_preemptions}
        if self.prefix_cache is not None:
            stats["prefix_cache_hit_rate"] = self.prefix_cache.hit_rate
        if self.speculator is not None:
            stats.update(self.stats_counters.as_dict())
        return stats

    def _warm(self, num_rows: int, num_tokens: int) -> None:
        logits, taps = self.runner.run([], num_rows, num_tokens)
        if self.speculator is not None:
            self.speculator.observe([], taps)
        for params in sampling.VARIANTS:
            self._sample(logits, [(0, Request("warmup", [0], params, -1))])

    # steps

    def step(self, *, deltas: bool = False) -> list[RequestOutput]:
        """Runs one step; returns the requests that got a token or finished (with `deltas`, only what
        each got since its last output: a server's streams need nothing more, and nothing is copied
        twice)."""
        plan = self.scheduler.schedule()
        self.idle = not plan
        try:
            requests = self._execute(plan)
        except Exception as error:
            return self._isolate(plan, error, deltas)
        for request in requests:
            request.suspect = False  # it ran a step to a token
        return [self._output(r, deltas) for r in requests]

    def _execute(self, plan) -> list[Request]:
        touched = []
        if plan.prefill:
            rows = [(r.tokens[r.computed:r.computed + n], r) for r, n in plan.prefill]
            touched += self.emit(self._run(rows, bucket(len(rows), self.prefill_rows),
                                            bucket(max(len(t) for t, _ in rows), self.prefill_tokens)))
        if plan.decode and self.speculator is not None:
            touched += speculation.verify_step(self, plan.decode)
        elif plan.decode:
            rows = [(r.tokens[r.computed:], r) for r in plan.decode]
            touched += self.emit(self._run(rows, bucket(len(rows), self.decode_rows), 1))
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
        follow a stop in the same step (a speculative window's) are dropped. Public with
        `penalty_inputs`: a speculative step (serve/dspark/speculation.py) emits its accepted tokens
        and builds its sampler's penalty inputs through them."""
        for request, token, logprobs in sampled:
            if request.status is not Status.FINISHED:
                if logprobs is not None:
                    request.logprobs.append(logprobs)
                self._append(request, token)
        return [r for r, _, _ in sampled]

    def _run(self, rows, num_rows: int, num_tokens: int) -> list[tuple[Request, int, dict | None]]:
        for _, request in rows:  # prefix-cache hits resume from a KDA snapshot
            if request.restore_from is not None:
                self.runner.copy_slot(request.restore_from, request.slot)
                request.restore_from = None
        logits, taps = self.runner.run([(new, r.computed, r.slot, r.pages) for new, r in rows], num_rows, num_tokens)
        if self.speculator is not None:  # the draft reads the target's hidden states of these tokens
            self.speculator.observe([(r, r.computed, len(new)) for new, r in rows], taps)
        for new, request in rows:
            request.computed += len(new)
            if self.prefix_cache is not None and (copy := self.scheduler.register(request)) is not None:
                self.runner.copy_slot(*copy)
        ready = [(i, r) for i, (_, r) in enumerate(rows) if r.pending == 0]
        if not ready:
            return []
        return [(r, *picked) for (_, r), picked in zip(ready, self._sample(logits, ready))]

    def _sample(self, logits, ready) -> list[tuple[int, dict | None]]:
        """Samples the next token of each ready row (row index, request); the logits' other rows are padding.
        Returns (token, its logprobs entry or None) per ready row."""
        result = self._sampler_inputs(ready, logits.shape[0])(logits)
        wants_logprobs = any(r.params.logprobs is not None for _, r in ready)
        tokens = np.asarray(result.tokens)
        entries = [None] * len(ready)
        if wants_logprobs:
            chosen, top_ids, top = map(np.asarray, (result.logprob, result.top_ids, result.top_logprobs))
            entries = [sampling.logprobs_entry(r.params.logprobs, tokens[i], chosen[i], top_ids[i], top[i])
                       for i, r in ready]
        return [(int(tokens[i]), entry) for (i, _), entry in zip(ready, entries)]

    def _sampler_inputs(self, ready, num_rows: int) -> "_Sampler":
        """The sampler's inputs for the ready rows of a [num_rows, vocab] step."""
        params: list = [None] * num_rows
        generated, ids = [0] * num_rows, [0] * num_rows
        for i, request in ready:
            params[i], generated[i], ids[i] = request.params, len(request.output), request.arrival
        batch = sampling.SamplingBatch.from_params(params, num_rows, num_generated=generated, request_ids=ids,
                                                   eos_token_ids=sorted(self.eos_ids), engine_seed=self.options.seed,
                                                   vocab_size=self.model.config.vocab_size)
        counts, prompt_mask = self.penalty_inputs(ready, num_rows, self.model.config.vocab_size)
        wants_logprobs = any(r.params.logprobs is not None for _, r in ready)
        return _Sampler(batch, counts, prompt_mask, sampling.MAX_LOGPROBS if wants_logprobs else 0,
                        self.model.config.vocab_size)

    def penalty_inputs(self, ready, num_rows: int, vocab: int):
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

    def _append(self, request: Request, token: int) -> None:
        request.output.append(token)
        params = request.params
        if self.tokenizer is not None and self._text(request).feed(token):
            self.scheduler.finish(request, "stop")  # a stop string
        elif token in self.eos_ids and not params.ignore_eos:
            self.scheduler.finish(request, "stop")
        elif params.stop_token_ids and token in params.stop_token_ids:
            self.scheduler.finish(request, "stop")
        elif (params.max_tokens is not None and len(request.output) >= params.max_tokens) \
                or len(request.tokens) >= self.options.max_model_len:
            self.scheduler.finish(request, "length")

    def _text(self, request: Request) -> _Text:
        if request.id not in self._texts:
            self._texts[request.id] = _Text(self.tokenizer, request.params)
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
        start = request.num_sent if delta else 0
        request.num_sent = len(request.output)
        logprobs = request.logprobs[start:] if request.params.logprobs is not None else None
        return RequestOutput(request.id, request.prompt, request.output[start:], request.finish_reason, logprobs,
                             text)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer files: send token ids, not text")
            prompt = self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise ValueError(f"prompt: token ids must lie in [0, {vocab})")
        if not ids:  # nothing to compute a first token from: it would wait at the head of the queue forever
            raise ValueError("prompt: must not be empty")
        return ids


@dataclasses.dataclass
class _Sampler:
    """`sampling.sample` with one step's inputs bound: called on the logits, or compiled ahead."""

    batch: sampling.SamplingBatch
    counts: np.ndarray | None
    prompt_mask: np.ndarray | None
    num_logprobs: int
    vocab_size: int

    def __call__(self, logits):
        return sampling.sample(logits, self.batch, self.counts, self.prompt_mask, num_logprobs=self.num_logprobs)

    def compile(self) -> None:
        logits = jax.ShapeDtypeStruct((self.batch.temperature.shape[0], self.vocab_size), jnp.float32)
        sampling.sample.lower(logits, self.batch, self.counts, self.prompt_mask,
                              num_logprobs=self.num_logprobs).compile()


class _Text:
    """A request's output text, detokenized as tokens arrive; `feed` says when a stop string appeared
    (the text is then cut before it, as OpenAI and vLLM return it)."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.decoder = tokenizer.incremental_decoder(skip_special_tokens=params.skip_special_tokens)
        self.stops = params.stop
        self.text = ""
        self.stopped = False
        self.finished = False
        # Text that a stop string could still begin in is not handed out: it might be cut.
        self.holdback = max((len(stop) for stop in self.stops), default=1) - 1
        self.sent = 0

    def feed(self, token: int) -> bool:
        start = len(self.text)
        self.text += self.decoder.feed(token)
        # a stop string may straddle the previous text and the new piece; the earliest one wins
        found = [at for stop in self.stops if (at := self.text.find(stop, max(0, start - len(stop) + 1))) >= 0]
        if found:
            self.text = self.text[:min(found)]
            self.stopped = True
        return self.stopped

    def finish(self) -> None:
        """Completes the text with the bytes of a character the last token left unfinished, unless cut."""
        if not self.stopped and not self.finished:
            self.text += self.decoder.finish()
        self.finished = True

    def take(self, final: bool) -> str:
        """The text not handed out yet that no stop string can cut any more (all of it when final)."""
        end = len(self.text) if final else max(self.sent, len(self.text) - self.holdback)
        new, self.sent = self.text[self.sent:end], end
        return new
