"""Continuous batching: which requests run in the next step, and how many of their tokens.

Each step runs the decoding requests (one token each, plus their speculative drafts when the budget
leaves room) and prefill chunks of the others within a token budget: a long prompt is spread over
steps with its KDA state and MLA pages carried, so a prefill never stalls the decodes. Requests are
admitted first come, first served while a slot, pages and room under `max_num_seqs` remain. When a decoding request needs a page and none is free, the
most recently admitted request is preempted: its pages and slot are freed and it restarts later by
recomputing its prompt and the tokens it already generated (so its output does not change).
A suspect (a request of a step that failed, see serve/engine.py) runs alone: it is admitted only
into an empty batch, and nothing joins it until its next token. A paused request (its reader is
behind) keeps its pages and slot but takes no part in steps until it is resumed.
A request of an agent session (serve/sessions.py) snapshots its KDA state at every page boundary it
reaches, keeping only the latest of those, and when it finishes the prefix cache pins what it leaves
cached; pins expire after their TTL, and give way (oldest first) only when a step could otherwise
run nothing for want of pages.
DP attention (a mesh with data > 1): each request runs in one data group, whose pages and slots it
holds (serve/cache.py). A request joins the group where the prefix cache holds most of its prompt,
then the one with most free pages; each group takes its share of max_num_seqs and of the prefill rows,
and a request short of a page preempts the latest admitted request of its own group.
Images are encoded in the step whose chunk first reaches them; the encoder runs on at most
`encoder_budget` image tokens a step (vLLM's encoder budget; one image however large when the step
has none yet): a chunk that would reach an image past it ends where that image starts.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

from serve.cache import CacheAllocator
from serve.prefix_cache import PrefixCache
from serve.sessions import SessionPins


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: object  # serve.sampling.SamplingParams
    arrival: int
    output: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose KDA state and MLA rows are in the cache
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    group: int = 0  # the data group whose pages and slot it holds (DP attention), set at admission
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    logprobs: list[dict] = dataclasses.field(default_factory=list)  # per output token, when asked for
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # prefix-cache hash of each full page
    restore_from: int | None = None  # a prefix-cache snapshot slot to copy into `slot` before running
    drafts: list[int] = dataclasses.field(default_factory=list)  # speculative tokens the next step verifies
    draft_logits: object = None  # with probabilistic drafting: (device array, row) of the drafts' logits
    suspect: bool = False  # in a step that failed: runs alone until it samples a token
    paused: bool = False  # left out of steps (its reader has too much unread output)
    num_sent: int = 0  # output tokens handed out as deltas
    images: list = dataclasses.field(default_factory=list)  # serve.multimodal.ImageSpan per image, in order
    cache_prompt: list[int] | None = None  # what the prefix cache hashes for the prompt, when not the prompt
    session: str | None = None  # its agent session's key (prompt_cache_key): its prefix is pinned when it finishes
    trail: bytes | None = None  # the page whose snapshot it took last past its prompt's boundary (a session's)
    num_cached_tokens: int = 0  # prompt tokens its last admission found in the prefix cache
    # Prefill/decode disaggregation (serve/disagg), each a serve.disagg.handoff.Handoff or None:
    imported: object = None  # the prefill server's cache of all but the last prompt token, written before the first step
    exported: object = None  # a PrefillOnly request's own cache once its prompt is computed, for a decode engine

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def cache_tokens(self) -> list[int]:
        """The tokens as the prefix cache keys them: an image's pad positions carry its content key
        (serve/multimodal.py), so two images behind the same text never share pages."""
        return self.tokens if self.cache_prompt is None else self.cache_prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens still to feed before the next token can be sampled (1 when decoding)."""
        return len(self.prompt) + len(self.output) - self.computed


@dataclasses.dataclass
class StepPlan:
    decode: list[Request]  # one token each
    prefill: list[tuple[Request, int]]  # (request, tokens of this chunk)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, allocator: CacheAllocator, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_chunk: int, max_prefill_rows: int, whole_chunks: bool = False, encoder_cache=None,
                 encoder_budget: int = 0, sessions: SessionPins | None = None):
        """whole_chunks: a prefill chunk is always min(pending, max_prefill_chunk) tokens, waiting for a
        later step rather than shortened by what others leave of the budget or the pages, so that how
        a prompt is chunked (which changes its numbers) depends on that prompt alone.
        encoder_cache: the engine's serve.encoder_cache.EncoderCache (a model with a vision tower), whose
        images need no encoder run; encoder_budget: image tokens a step may encode.
        sessions: the agent sessions' pins in the prefix cache (with prefix caching)."""
        self.allocator = allocator
        self.prefix_cache: PrefixCache | None = allocator.prefix_cache
        self.page_size = allocator.layout.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.max_prefill_rows = max_prefill_rows
        self.groups = allocator.layout.groups
        self.max_seqs_per_group = -(-max_num_seqs // self.groups)
        self.max_prefill_rows_per_group = -(-max_prefill_rows // self.groups)
        self.whole_chunks = whole_chunks
        self.encoder_cache = encoder_cache
        self.encoder_budget = encoder_budget
        self.sessions = sessions
        self._encoding: dict[bytes, int] = {}  # this step's images to encode: digest -> tokens
        self._short_of_pages = False  # this step left a request without the page it needed
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        # prompt tokens admitted for computing: not found in the prefix cache (again after a preemption)
        self.num_computed_prompt_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        if self.sessions is not None:
            self.sessions.expire()
        plan = self._schedule()
        # Pins hold pages for a later turn, not against a request that could otherwise not run at all.
        while not plan and self._short_of_pages and self.sessions is not None and self.sessions.release_oldest():
            plan = self._schedule()
        return plan

    def _schedule(self) -> StepPlan:
        self._encoding, self._short_of_pages = {}, False
        decode = [r for r in self.running if r.pending == 1 and not r.paused]
        for request in list(decode):
            if request.status is not Status.RUNNING:  # preempted while making room for an earlier one
                continue
            if request.drafts and not self.reserve(request, 1 + len(request.drafts)):
                request.drafts, request.draft_logits = [], None  # speculation never preempts anyone
            while not self.reserve(request, 1):
                self._short_of_pages = True
                victim = next(r for r in reversed(self.running) if r.group == request.group)
                self._preempt(victim)
                if victim is request:
                    break
        decode = [r for r in decode if r.status is Status.RUNNING]
        budget = self.max_num_batched_tokens - len(decode)
        for request in decode:  # drafts ride in what the budget leaves after one token per decode
            request.drafts = request.drafts[:max(budget, 0)]
            budget -= len(request.drafts)
        prefill: list[tuple[Request, int]] = []
        for request in [r for r in self.running if r.pending > 1 and not r.paused]:  # chunked prefills under way
            if budget <= 0 or len(prefill) == self.max_prefill_rows:
                break
            if self._prefill_rows_in(prefill, request.group) == self.max_prefill_rows_per_group:
                continue
            chunk = self._chunk(request, budget)
            if chunk:
                prefill.append((request, chunk))
                budget -= chunk
        while self.waiting and budget > 0 and len(prefill) < self.max_prefill_rows \
                and len(self.running) < self.max_num_seqs and not any(r.suspect for r in self.running):
            request = self.waiting[0]
            if request.suspect and self.running:
                break
            slot = self._admit_slot(request, prefill)
            if slot is None:
                break
            request.slot = slot
            if request.imported is not None:  # a prefilled prompt: only its last token is left to compute
                request.computed = request.imported.num_tokens
            elif self.prefix_cache is not None:
                request.hashes, request.pages, request.restore_from = self.prefix_cache.lookup(
                    request.cache_tokens, lambda chain, hit: self.allocator.restore(chain, hit, slot), request.group)
                request.computed = request.num_cached_tokens = len(request.pages) * self.page_size
            chunk = self._chunk(request, budget)
            if not chunk:
                self._release(request)
                break
            self.waiting.popleft()
            self.num_computed_prompt_tokens += max(len(request.prompt) - request.computed, 0)
            request.status = Status.RUNNING
            self.running.append(request)
            prefill.append((request, chunk))
            budget -= chunk
            if request.suspect:
                break
        return StepPlan(decode, prefill)

    def _admit_slot(self, request: Request, prefill: list[tuple[Request, int]]) -> int | None:
        """A slot for a waiting request, in the data group it should join (`request.group`), or None
        when no group has room for it this step."""
        if self.groups == 1:
            return self.allocator.allocate_slot()
        running = [0] * self.groups
        for r in self.running:
            running[r.group] += 1
        open_groups = [g for g in range(self.groups) if running[g] < self.max_seqs_per_group
                       and self._prefill_rows_in(prefill, g) < self.max_prefill_rows_per_group]

        def preference(g: int):
            cached = self.prefix_cache.cached_pages(request.cache_tokens, g) if self.prefix_cache is not None else 0
            return -cached, -self.allocator.free_pages_in(g), running[g], g

        for group in sorted(open_groups, key=preference):
            if (slot := self.allocator.allocate_slot(group)) is not None:
                request.group = group
                return slot
        return None

    @staticmethod
    def _prefill_rows_in(prefill: list[tuple[Request, int]], group: int) -> int:
        return sum(r.group == group for r, _ in prefill)

    def finish(self, request: Request, reason: str) -> None:
        """Ends a request (done, stopped or cancelled) and frees its pages and slot at once; a session's
        request pins its cached prefix first (not after an error: its state is suspect)."""
        if request.session is not None and self.sessions is not None and reason != "error":
            self.sessions.pin(request.session, request.hashes)
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status, request.finish_reason = Status.FINISHED, reason

    def snapshot_boundary(self, request: Request) -> int:
        """Where a request's KDA state is snapshotted for the prefix cache: its last page boundary
        before its last known token (a hit must leave one token to compute)."""
        return (len(request.prompt) + len(request.output) - 1) // self.page_size * self.page_size

    def register(self, request: Request) -> tuple[int, int] | None:
        """After a step: caches the request's newly filled pages. Returns (request slot, snapshot slot)
        when the request just reached its snapshot boundary and its state should be copied there."""
        cache = self.prefix_cache
        full, start = request.computed // self.page_size, len(request.hashes)
        if full > start:
            hashes = cache.chain(request.cache_tokens, start, full,
                                 request.hashes[-1] if request.hashes else cache.root(request.group))
            for page, h in zip(request.pages[start:full], hashes):
                cache.insert(h, page)
            request.hashes += hashes
        boundary = self.snapshot_boundary(request)
        # a session's request snapshots every page boundary: its pin then ends at its last full page
        trailing = request.session is not None and request.computed % self.page_size == 0 \
            and request.computed != boundary
        if not request.computed or not (trailing or request.computed == boundary):
            return None
        h = request.hashes[request.computed // self.page_size - 1]
        if not cache.wants_snapshot(h) or (slot := self.allocator.allocate_slot(request.group)) is None:
            return None
        cache.set_snapshot(h, slot)
        if trailing:  # only the latest of these is worth a slot: the previous one is a prefix of it
            if request.trail is not None and (previous := cache.drop_snapshot(request.trail)) is not None:
                self.allocator.free([], previous)
            request.trail = h
        return request.slot, slot

    def keep_snapshot(self, request: Request, boundary: int, slot: int) -> None:
        """A KDA state taken at a page boundary inside a speculative window (in `slot`): kept as that
        page's snapshot if the page is cached and has none, else the slot is freed."""
        cache, index = self.prefix_cache, boundary // self.page_size - 1
        if request.status is not Status.FINISHED and index < len(request.hashes) and \
                cache.wants_snapshot(request.hashes[index]):
            cache.set_snapshot(request.hashes[index], slot)
        else:
            self.allocator.free([], slot)

    def _chunk(self, request: Request, budget: int) -> int:
        """The largest chunk of the request's pending tokens that fits the budget and the free pages
        (0 when not even one token fits); its pages are reserved."""
        chunk = min(request.pending, budget, self.max_prefill_chunk)
        if self.prefix_cache is not None and request.computed < self.snapshot_boundary(request):
            chunk = min(chunk, self.snapshot_boundary(request) - request.computed)  # end where the snapshot is taken
        chunk = self._encoder_fit(request, chunk)
        if self.whole_chunks:
            whole = min(request.pending, self.max_prefill_chunk)
            return whole if chunk == whole and self.reserve(request, whole) else 0
        wanted = chunk
        while chunk > 0 and not self.reserve(request, chunk):
            chunk = min(chunk - 1, self._fits(request))
        self._short_of_pages |= wanted > 0 >= chunk
        return max(chunk, 0)

    def _encoder_fit(self, request: Request, chunk: int) -> int:
        """The chunk, ended where it would reach an image whose encoder run passes this step's budget;
        the images it reaches are counted in."""
        start = request.computed
        for span in request.images:
            if span.end <= start or span.start >= start + chunk or span.image.digest in self._encoding \
                    or span.image in self.encoder_cache:
                continue
            if self._encoding and sum(self._encoding.values()) + span.image.num_tokens > self.encoder_budget:
                return max(span.start - start, 0)
            self._encoding[span.image.digest] = span.image.num_tokens
        return chunk

    def _fits(self, request: Request) -> int:
        """Most new tokens the request's pages plus the free pages can hold."""
        capacity = (len(request.pages) + self.allocator.free_pages_in(request.group)) * self.allocator.layout.page_size
        return capacity - request.computed

    def reserve(self, request: Request, new_tokens: int) -> bool:
        """Makes the request's pages cover `new_tokens` more tokens; False (nothing taken) when pages run out."""
        needed = self.allocator.pages_for(request.computed + new_tokens) - len(request.pages)
        if needed <= 0:
            return True
        pages = self.allocator.allocate_pages(needed, request.group)
        if pages is None:
            return False
        request.pages.extend(pages)
        return True

    def _release(self, request: Request) -> None:
        """Frees (or hands back to the prefix cache) everything the request holds."""
        self.allocator.free(request.pages, request.slot)
        request.pages, request.slot, request.computed, request.hashes, request.restore_from = [], None, 0, [], None
        request.trail = None
        request.drafts, request.draft_logits = [], None

    def preempt(self, request: Request, *, suspect: bool = False) -> None:
        """Sends a running request back to the front of the queue; it recomputes its tokens when readmitted."""
        request.suspect = suspect
        self._preempt(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
