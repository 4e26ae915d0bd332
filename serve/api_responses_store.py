"""The Responses API's stored responses (serve/api_responses.py) and its background runs.

The last MAX_STORED responses of this process are kept, each with the conversation it ends, which
`previous_response_id` continues. A background response (`background: true`, as vLLM serves it)
is stored at once as "queued" and runs as an asyncio task: "in_progress" once the engine's first
output arrives, then its final envelope ("completed", "incomplete"), or "failed" with its error.
Cancelling one (POST /v1/responses/{id}/cancel) marks it "cancelled", cancels the task and aborts its
engine request, and answers the stored response, as vLLM does; any other response answers vLLM's
400 "Cannot cancel a synchronous response.". A streamed background response keeps its events: its
POST streams them as they come, and GET ?stream=true&starting_after=N replays them from event N + 1
on, whether or not the client that created it is still there. Forgetting a response that still
runs (DELETE, or the oldest going past MAX_STORED) cancels its run.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from serve.api_common import APIError

logger = logging.getLogger(__name__)

MAX_STORED = 1024  # responses kept for previous_response_id and GET; the oldest goes first
RUNNING = ("queued", "in_progress")  # the statuses a background response can be cancelled in
FINISHED = ("completed", "incomplete")  # those of a response with an output to continue from


@dataclasses.dataclass
class _Run:
    """A background response's task; a streamed one's events so far."""

    abort: Callable[[], None]  # aborts its engine request (a task cancelled before it starts runs no `finally`)
    events: list[str] | None  # None: not streamed
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    def cancel(self) -> None:
        self.task.cancel()
        self.abort()


@dataclasses.dataclass
class _Entry:
    conversation: list  # the input items of the whole conversation, this response's output included
    response: dict  # what GET returns
    run: _Run | None = None  # a background response's


class ResponseStore:
    def __init__(self, max_stored: int = MAX_STORED):
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._max_stored = max_stored

    def conversation(self, response_id: str) -> list:
        """The conversation that a stored response ends, for `previous_response_id` to continue: a
        400 unless the response is stored and finished (a queued, running, cancelled or failed one
        has no output to continue from)."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(400, f"previous_response_id: no stored response {response_id!r} (responses are kept in "
                                "this server process only)", param="previous_response_id")
        if entry.response["status"] not in FINISHED:
            raise APIError(400, f"previous_response_id: response {response_id!r} is {entry.response['status']}; only "
                                "a finished response can be continued", param="previous_response_id")
        return entry.conversation

    def get(self, response_id: str) -> dict:
        return self._entry(response_id).response

    def _entry(self, response_id: str) -> _Entry:
        if response_id not in self._entries:
            raise APIError(404, f"Response with id {response_id!r} not found.", param="response_id")
        return self._entries[response_id]

    def put(self, response_id: str, conversation: list, response: dict) -> None:
        self._add(response_id, _Entry(conversation, response))

    def _add(self, response_id: str, entry: _Entry) -> None:
        self._entries[response_id] = entry
        while len(self._entries) > self._max_stored:
            self._stop(self._entries.popitem(last=False)[1])

    def finish(self, response_id: str, conversation: list, response: dict) -> None:
        """A background response's final envelope, unless it was cancelled or forgotten meanwhile."""
        entry = self._entries.get(response_id)
        if entry is not None and entry.response["status"] in RUNNING:
            entry.conversation, entry.response = conversation, response

    def started(self, response_id: str) -> None:
        """A queued background response's engine request gave its first output."""
        entry = self._entries.get(response_id)
        if entry is not None and entry.response["status"] == "queued":
            entry.response = {**entry.response, "status": "in_progress"}

    def run_in_background(self, response_id: str, queued: dict, work: Awaitable | AsyncIterator[str],
                          abort: Callable[[], None]) -> None:
        """Stores the `queued` response and runs `work` as a task: a coroutine that finishes the
        response, or the SSE events of a streamed one, which are kept for `events`."""
        run = _Run(abort, None if isinstance(work, Awaitable) else [])
        entry = _Entry([], queued, run)
        self._add(response_id, entry)
        run.task = asyncio.create_task(self._background(entry, work))
        # Readers of its events stop once it is done, even if it was cancelled before it started.
        run.task.add_done_callback(lambda _: run.changed.set())

    async def _background(self, entry: _Entry, work: Awaitable | AsyncIterator[str]) -> None:
        run, message = entry.run, "the response ended without a result; see the server log"
        try:
            if run.events is None:
                await work
            else:
                async for event in work:
                    run.events.append(event)
                    run.changed.set()
        except APIError as error:
            message = error.message
        except Exception:
            logger.exception("background response %s failed", entry.response["id"])
            message = "internal error; see the server log"
        finally:
            run.abort()  # nothing when it finished
            if entry.response["status"] in RUNNING:  # neither finished nor cancelled
                entry.response = {**entry.response, "status": "failed",
                                  "error": {"code": "server_error", "message": message}}

    def events(self, response_id: str, starting_after: int | None) -> AsyncIterator[str]:
        """A streamed background response's events after the `starting_after`-th (from the first
        when None), then those to come until it ends."""
        run = self._entry(response_id).run
        if run is None or run.events is None:
            raise APIError(400, "stream: only the events of a response created with background and stream are "
                                "kept", param="stream")
        return self._replay(run, 0 if starting_after is None else starting_after + 1)

    @staticmethod
    async def _replay(run: _Run, index: int) -> AsyncIterator[str]:
        while True:
            run.changed.clear()
            while index < len(run.events):
                yield run.events[index]
                index += 1
            if run.task.done():
                return
            await run.changed.wait()

    async def cancel(self, response_id: str) -> dict:
        entry = self._entry(response_id)
        if entry.response["status"] not in RUNNING:
            raise APIError(400, "Cannot cancel a synchronous response.", param="response_id")
        entry.response = {**entry.response, "status": "cancelled"}
        entry.run.cancel()
        await asyncio.wait([entry.run.task])  # its engine request is aborted once this returns
        return entry.response

    def forget(self, response_id: str) -> None:
        self._stop(self._entry(response_id))
        del self._entries[response_id]

    @staticmethod
    def _stop(entry: _Entry) -> None:
        if entry.run is not None and not entry.run.task.done():
            entry.run.cancel()
