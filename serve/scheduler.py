"""Continuous batching: which requests run in the next step, and how many of their tokens.

Each step runs the decoding requests (one token each) and prefill chunks of the others within a
token budget: a long prompt is spread over steps with its KDA state and MLA pages carried, so a
prefill never stalls the decodes. Requests are admitted first come, first served while a slot, pages
and room under `max_num_seqs` remain. When a decoding request needs a page and none is free, the
most recently admitted request is preempted: its pages and slot are freed and it restarts later by
recomputing its prompt and the tokens it already generated (so its output does not change).
"""

from __future__ import annotations

import collections
import dataclasses
import enum

from serve.cache import CacheAllocator


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
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    logprobs: list[dict] = dataclasses.field(default_factory=list)  # per output token, when asked for

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

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
                 max_prefill_chunk: int, max_prefill_rows: int):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.max_prefill_rows = max_prefill_rows
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        decode = [r for r in self.running if r.pending == 1]
        for request in list(decode):
            if request.status is not Status.RUNNING:  # preempted while making room for an earlier one
                continue
            while not self._reserve(request, 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
        decode = [r for r in decode if r.status is Status.RUNNING]
        budget = self.max_num_batched_tokens - len(decode)
        prefill: list[tuple[Request, int]] = []
        for request in [r for r in self.running if r.pending > 1]:  # chunked prefills under way
            if budget <= 0 or len(prefill) == self.max_prefill_rows:
                break
            chunk = self._chunk(request, budget)
            if chunk:
                prefill.append((request, chunk))
                budget -= chunk
        while self.waiting and budget > 0 and len(prefill) < self.max_prefill_rows \
                and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            slot = self.allocator.allocate_slot()
            if slot is None:
                break
            request.slot = slot
            chunk = self._chunk(request, budget)
            if not chunk:
                self.allocator.free([], slot)
                request.slot = None
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            prefill.append((request, chunk))
            budget -= chunk
        return StepPlan(decode, prefill)

    def finish(self, request: Request, reason: str) -> None:
        """Ends a request (done, stopped or cancelled) and frees its pages and slot at once."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        self.allocator.free(request.pages, request.slot)
        request.pages, request.slot = [], None
        request.status, request.finish_reason = Status.FINISHED, reason

    def _chunk(self, request: Request, budget: int) -> int:
        """The largest chunk of the request's pending tokens that fits the budget and the free pages
        (0 when not even one token fits); its pages are reserved."""
        chunk = min(request.pending, budget, self.max_prefill_chunk)
        while chunk > 0 and not self._reserve(request, chunk):
            chunk = min(chunk - 1, self._fits(request))
        return max(chunk, 0)

    def _fits(self, request: Request) -> int:
        """Most new tokens the request's pages plus the free pages can hold."""
        capacity = (len(request.pages) + self.allocator.free_pages) * self.allocator.layout.page_size
        return capacity - request.computed

    def _reserve(self, request: Request, new_tokens: int) -> bool:
        needed = self.allocator.pages_for(request.computed + new_tokens) - len(request.pages)
        if needed <= 0:
            return True
        pages = self.allocator.allocate_pages(needed)
        if pages is None:
            return False
        request.pages.extend(pages)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request.pages, request.slot)
        request.pages, request.slot, request.computed = [], None, 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
