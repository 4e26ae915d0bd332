"""The engine behind the HTTP server: one thread owns the `Engine` and does all of its work.

The event loop never calls the engine. Submissions and aborts reach the engine thread through one
thread-safe inbox, in order (an abort never overtakes its submission); the thread runs
`Engine.step()` while there is work and sleeps on the inbox when there is none, and hands a step's
outputs to their submitters' asyncio queues with one `loop.call_soon_threadsafe` per event loop (each
call wakes the loop through its self-pipe; one per output woke it once per stream per step). The
requests in the engine are bounded (the running batch plus `max_queued_requests` waiting), so a flood
of requests is answered with 503s instead of growing memory.

Outputs travel as deltas (what each step added), so a request's output is copied once, not once
per step. The engine thread never waits for a reader; instead, before each step, a group whose
reader has more than `max_backlog` outputs per request unread is paused (its requests keep their
cache but take no part in steps) until the reader catches up, and aborted if it stays behind for
`stall_timeout_s`: a reader that does not read stalls only its own requests, and what it makes the
server hold is bounded. A request that fails alone (finish_reason "error") fails its group with
RequestFailed; the others go on. When a step finds nothing to run, the thread sleeps until the next
command (polling while a group is paused) rather than spinning.

A thread, not a process of its own as vLLM's engine core: on a 2-core machine a Python load of the
HTTP side's CPU share slows the offline engine as much from another process as from a thread of its
process, or more (benchmarks/engine_contention.py), so what serving costs the engine there is CPU time,
which a second process would not give back; it would add the outputs' trip between processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time

from serve.engine import Engine, RequestOutput
from serve.metrics import ServerMetrics
from serve.sampling import SamplingParams

logger = logging.getLogger(__name__)


# How often the engine thread looks at paused groups' readers when it has nothing else to do.
PAUSED_POLL_S = 0.01


class QueueFull(Exception):
    """The engine holds as many requests as it may; the client should retry later (503)."""


class EngineDead(Exception):
    """The engine thread has stopped; nothing more will be served."""


class RequestFailed(Exception):
    """A request of the group failed in the engine (details in the server log) or was aborted."""


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_queued_requests: int, metrics: ServerMetrics | None = None,
                 max_backlog: int = 256, stall_timeout_s: float = 30.0):
        self.engine = engine
        self.max_backlog = max_backlog  # unread outputs per request of a group before the group is paused
        self.stall_timeout_s = stall_timeout_s
        self.metrics = metrics or ServerMetrics()
        self.capacity = engine.options.max_num_seqs + max_queued_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._num_requests = 0  # submitted and not yet finished; guarded by _lock
        self._lock = threading.Lock()
        self._group_ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # Engine-thread state: request id -> its group, its index there and its token timings.
        self._requests: dict[str, _Tracked] = {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer  # immutable and thread-safe: the HTTP layer may use it

    @property
    def max_model_len(self) -> int:
        return self.engine.options.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.vocab_size

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(_STOP)
        self._thread.join()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(self, requests: list[tuple[str | list[int], SamplingParams]]) -> RequestGroup:
        """Queues (prompt, params) requests as one group and returns it once the engine accepted
        them all. Raises QueueFull when they do not fit, ValueError naming the problem when the
        engine refuses one (then none of them runs), EngineDead when the engine thread is gone."""
        if not self.is_alive():
            raise EngineDead("the engine has stopped")
        if len(requests) > self.capacity:
            raise ValueError(f"n: {len(requests)} sequences in one request; this server holds at most "
                             f"{self.capacity} at once")
        with self._lock:
            if self._num_requests + len(requests) > self.capacity:
                self.metrics.requests_rejected.inc()
                raise QueueFull(f"the server is at capacity ({self.capacity} requests); retry later")
            self._num_requests += len(requests)
        group_id = next(self._group_ids)
        group = RequestGroup(self._inbox, [f"{group_id}-{i}" for i in range(len(requests))],
                             asyncio.get_running_loop(), time.monotonic())
        self._inbox.put(_Submit(group, requests))
        try:
            accepted = await group.queue.get()
            group.taken += 1
        except asyncio.CancelledError:  # the client left while we waited: take the requests back out
            group.abort()
            raise
        if isinstance(accepted, BaseException):
            raise accepted
        return group

    # The engine thread.

    def _run(self) -> None:
        while True:
            paused, changed = self._throttle()
            idle = self.engine.idle and not changed  # nothing to run until a command or a resumed reader
            commands = self._take_commands(wait=idle or not self.engine.has_unfinished(),
                                           timeout=PAUSED_POLL_S if paused else None)
            if _STOP in commands:
                return
            try:
                for command in commands:
                    if isinstance(command, _Submit):
                        self._submit(command)
                    else:
                        self._abort(command)
                if self.engine.has_unfinished() and (commands or not idle):
                    self._deliver(self.engine.step(deltas=True))
            except Exception as error:  # an engine bug: fail what is in flight, keep serving new requests
                logger.exception("engine step failed; failing the %d requests in flight", len(self._requests))
                self._fail_all(error)
            try:
                self.metrics.observe_engine(self.engine)
            except Exception:  # a metrics bug must not stop the engine loop
                logger.exception("refreshing the engine metrics failed")

    def _take_commands(self, wait: bool, timeout: float | None) -> list:
        commands = []
        if wait:
            try:
                commands.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _submit(self, submit: _Submit) -> None:
        group = submit.group
        try:
            for index, (request_id, (prompt, params)) in enumerate(zip(group.request_ids, submit.requests)):
                self.engine.add_request(prompt, params, request_id)
                self._requests[request_id] = _Tracked(group, index)
        except Exception as error:  # ValueError: a bad prompt; the group runs whole or not at all
            for request_id in group.request_ids:
                if self._requests.pop(request_id, None) is not None:
                    self.engine.abort(request_id)
            self._release(len(group.request_ids))
            group.post(error)
            return
        group.post(None)  # accepted

    def _abort(self, abort: _Abort) -> None:
        for request_id in abort.request_ids:
            if self._requests.pop(request_id, None) is not None:
                self.engine.abort(request_id)
                self.metrics.requests_finished.labels("abort").inc()
                self._release(1)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        posts = []
        for output in outputs:
            tracked = self._requests.get(output.request_id)
            if tracked is None:
                continue
            if output.finish_reason == "error":
                _post_all(posts)  # the group's earlier outputs go before its failure
                posts = []
                self._fail_group(tracked.group, "error", "the request failed while generating; see the server log")
                continue
            new_tokens = len(output.token_ids)
            if new_tokens:
                if tracked.num_tokens == 0:
                    self.metrics.time_to_first_token.observe(now - tracked.group.arrival)
                    self.metrics.prompt_tokens.inc(len(output.prompt_token_ids))
                else:
                    for _ in range(new_tokens):
                        self.metrics.inter_token_latency.observe((now - tracked.last_token_time) / new_tokens)
                self.metrics.generation_tokens.inc(new_tokens)
                tracked.num_tokens, tracked.last_token_time = tracked.num_tokens + new_tokens, now
            posts.append((tracked.group, (tracked.index, output)))
            if output.finished:
                del self._requests[output.request_id]
                self.metrics.requests_finished.labels(output.finish_reason).inc()
                self._release(1)
        _post_all(posts)

    def _throttle(self) -> tuple[bool, bool]:
        """Pauses the groups whose readers are more than max_backlog outputs per request behind and
        resumes those that caught up; aborts a group paused for longer than stall_timeout_s. Returns
        (whether any group stays paused, whether any was resumed or aborted)."""
        now, any_paused, changed = time.monotonic(), False, False
        for group in {tracked.group for tracked in self._requests.values()}:
            behind = group.backlog > self.max_backlog * len(group.request_ids)
            if behind != (group.stalled_since is not None):
                group.stalled_since = now if behind else None
                changed |= not behind
                for request_id in group.request_ids:
                    self.engine.pause(request_id, behind)
            if behind and now - group.stalled_since > self.stall_timeout_s:
                changed = True
                logger.warning("aborting a request whose client left %d outputs unread for %g s", group.backlog,
                               self.stall_timeout_s)
                self._fail_group(group, "abort", f"the client did not read its stream for {self.stall_timeout_s:g} s")
            else:
                any_paused |= behind
        return any_paused, changed

    def _fail_group(self, group: RequestGroup, reason: str, message: str) -> None:
        """Ends every request of the group still in the engine; its reader gets RequestFailed."""
        for request_id in group.request_ids:
            if self._requests.pop(request_id, None) is not None:
                self.engine.abort(request_id)
                self.metrics.requests_finished.labels(reason).inc()
                self._release(1)
        group.post(RequestFailed(message))

    def _fail_all(self, error: Exception) -> None:
        requests, self._requests = self._requests, {}
        for request_id, tracked in requests.items():
            tracked.group.post(RequestFailed("the engine failed; see the server log"))
            self.engine.abort(request_id)
        self._release(len(requests))

    def _release(self, count: int) -> None:
        with self._lock:
            self._num_requests -= count


class RequestGroup:
    """The engine requests of one HTTP request (one per prompt and choice). Iterating yields
    (index, RequestOutput) until every one has finished; `abort` cancels those still running."""

    def __init__(self, inbox: queue.SimpleQueue, request_ids: list[str], loop: asyncio.AbstractEventLoop,
                 arrival: float):
        self.request_ids = request_ids
        self.arrival = arrival
        self.queue: asyncio.Queue = asyncio.Queue()
        self._inbox = inbox
        self._loop = loop
        self._unfinished = set(range(len(request_ids)))
        # Outputs posted (written by the engine thread) and taken (by the reader); each int has one writer.
        self.posted = self.taken = 0
        self.stalled_since: float | None = None  # engine thread: since when the group is paused (None: it is not)

    @property
    def backlog(self) -> int:
        return self.posted - self.taken

    def post(self, item) -> None:
        """Hands an item to the group's queue (from the engine thread)."""
        _post_all([(self, item)])

    async def __aiter__(self):
        while self._unfinished:
            item = await self.queue.get()
            self.taken += 1
            if isinstance(item, BaseException):
                raise item
            index, output = item
            if output.finished:
                self._unfinished.discard(index)
            yield index, output

    def abort(self) -> None:
        if self._unfinished:
            self._inbox.put(_Abort([self.request_ids[i] for i in self._unfinished]))
            self._unfinished.clear()


def _post_all(posts: list[tuple[RequestGroup, object]]) -> None:
    """Hands each (group, item) to the group's queue, in order, waking each event loop once (from the
    engine thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for group, item in posts:
        group.posted += 1
        by_loop.setdefault(group._loop, []).append((group.queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_each, items)
        except RuntimeError:  # the submitters' event loop has closed: nobody is waiting for the items
            pass


def _put_each(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


@dataclasses.dataclass
class _Submit:
    group: RequestGroup
    requests: list[tuple[str | list[int], SamplingParams]]


@dataclasses.dataclass
class _Abort:
    request_ids: list[str]


@dataclasses.dataclass
class _Tracked:
    group: RequestGroup
    index: int
    num_tokens: int = 0
    last_token_time: float = 0.0


_STOP = object()
