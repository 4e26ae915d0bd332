"""Agent-session retention: a conversation's cached prefix pinned between its turns.

An agent resends its whole, growing conversation every turn. Under load the prefix cache's LRU may
evict that conversation between two turns, and the next turn prefills everything again. A request
that carries a session key (OpenAI's `prompt_cache_key`) therefore pins, when it finishes, the prefix
a hit would resume from: the cached MLA pages of its tokens up to the last KDA snapshot along them
(the scheduler snapshots a session's every page boundary, so that is the last full page it
computed). A pin holds a reference on each page, which the LRU never evicts, and protects the
snapshot; the next turn of the same session replaces it. A pin lasts `ttl_s` after its request
finished, then becomes an ordinary cache entry the LRU may evict. Pinned bytes (pages plus the
snapshot slot; a page two pins share counts twice) stay under `budget_bytes`, and pinned snapshots
under `max_pins` (the snapshot slots the pool set aside, so pins never keep a request from a slot):
over either, the oldest pins are released. When a running request finds no page anywhere else, the
oldest pin gives way before anyone is preempted (serve/scheduler.py).
"""

from __future__ import annotations

import collections
import dataclasses
import time

from serve.prefix_cache import PrefixCache
from serve.sampling import SamplingParams

MAX_KEY_CHARS = 256  # a key names a conversation; it is not content
DEFAULT_TTL_S = 300.0  # the low end of the 5-10 minutes OpenAI keeps a cached prefix after its last use
DEFAULT_BUDGET_FRACTION = 0.25  # of the cache's bytes, when no budget is given


@dataclasses.dataclass(frozen=True)
class SessionParams(SamplingParams):
    """SamplingParams of a request that belongs to an agent session: `prompt_cache_key` names the
    conversation whose prefix the engine keeps pinned between turns (serve/sessions.py). The key
    travels on the params because they are what every route (`/v1/chat/completions`,
    `/v1/completions`, the chat bridge of the Messages and Responses routes) and `LLM.generate`
    already hand to `Engine.add_request` per request."""

    prompt_cache_key: str | None = None

    def __post_init__(self):
        super().__post_init__()
        check_key(self.prompt_cache_key)


def check_key(key) -> None:
    """ValueError naming `prompt_cache_key` unless the key is None or a non-empty string of at most
    MAX_KEY_CHARS characters."""
    if key is not None and not (isinstance(key, str) and 0 < len(key) <= MAX_KEY_CHARS):
        raise ValueError(f"prompt_cache_key: must be a string of 1 to {MAX_KEY_CHARS} characters")


def session_key(params: SamplingParams) -> str | None:
    return params.prompt_cache_key if isinstance(params, SessionParams) else None


@dataclasses.dataclass
class Pin:
    hashes: list[bytes]  # the pinned pages' hash chain; the last one holds the snapshot
    expires: float
    nbytes: int


class SessionPins:
    def __init__(self, prefix_cache: PrefixCache, *, ttl_s: float, budget_bytes: int, max_pins: int,
                 page_bytes: int, slot_bytes: int, clock=time.monotonic):
        self.prefix_cache = prefix_cache
        self.ttl_s = ttl_s
        self.budget_bytes = budget_bytes
        self.max_pins = max_pins
        self.page_bytes = page_bytes
        self.slot_bytes = slot_bytes
        self.clock = clock
        self.pins: collections.OrderedDict[str, Pin] = collections.OrderedDict()  # oldest first
        self.nbytes = 0

    @staticmethod
    def for_cache(prefix_cache: PrefixCache, layout, options, *, page_bytes: int, slot_bytes: int) -> "SessionPins":
        """The pins of an engine (`options`: serve.engine.EngineOptions, `layout`: its pools): as many as
        it has snapshot slots, in `session_cache_bytes` or a quarter of the cache's bytes."""
        budget = options.session_cache_bytes
        if budget is None:
            budget = int(DEFAULT_BUDGET_FRACTION * (layout.num_pages * page_bytes + layout.num_slots * slot_bytes))
        return SessionPins(prefix_cache, ttl_s=options.session_ttl, budget_bytes=budget,
                           max_pins=layout.num_slots - layout.groups * (1 + -(-options.max_num_seqs // layout.groups)),
                           page_bytes=page_bytes,
                           slot_bytes=slot_bytes)

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0 and self.max_pins > 0 and self.budget_bytes >= self.page_bytes + self.slot_bytes

    @property
    def pinned_pages(self) -> int:
        return sum(len(pin.hashes) for pin in self.pins.values())

    def pin(self, key: str, hashes: list[bytes]) -> None:
        """Pins what a finished request of session `key` leaves cached along `hashes` (its pages' hash
        chain), replacing the session's previous pin; the oldest pins go when over budget. A request
        that leaves nothing to pin (aborted before it ran) leaves the previous pin in place."""
        pinned = self.prefix_cache.pin(hashes)
        if not pinned:
            return
        if (old := self.pins.pop(key, None)) is not None:  # after pinning the new chain, which usually extends it
            self._unpin(old)
        pin = Pin(pinned, self.clock() + self.ttl_s, len(pinned) * self.page_bytes + self.slot_bytes)
        self.pins[key] = pin
        self.nbytes += pin.nbytes
        while self.nbytes > self.budget_bytes or len(self.pins) > self.max_pins:
            self.release_oldest()

    def expire(self) -> None:
        """Releases the pins whose TTL has passed: their pages and snapshot become ordinary entries."""
        now = self.clock()
        for key in [k for k, pin in self.pins.items() if pin.expires <= now]:
            self._unpin(self.pins.pop(key))

    def release_oldest(self) -> bool:
        """Releases the oldest pin (a page is needed, or the budget is exceeded); False if there is none."""
        if not self.pins:
            return False
        self._unpin(self.pins.popitem(last=False)[1])
        return True

    def release_all(self) -> None:
        while self.pins:
            self._unpin(self.pins.popitem(last=False)[1])

    def _unpin(self, pin: Pin) -> None:
        self.prefix_cache.unpin(pin.hashes)
        self.nbytes -= pin.nbytes
