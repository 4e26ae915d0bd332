"""Hybrid prefix caching: full MLA pages keyed by a hash chain, and KDA state snapshots.

A page of `page_size` tokens is cached under the hash of (the previous page's hash, its tokens), so a
hash names the whole prefix up to the page's end. MLA rows of a cached page are shared read-only:
a request only ever writes rows past its cached prefix, in pages of its own. The KDA recurrence
cannot restart from the middle, so a prefix is usable only up to a page boundary where a snapshot
of every KDA layer's state (and conv window) was taken, kept in a spare slot of the slot pool. The
engine snapshots each prompt at its last full page (the prefill chunk is cut to end there).

Entries nobody uses are evicted least recently used first when pages or slots run out. A hit
and a miss give the same tokens: the hit resumes from exactly the state the miss would compute.
A pinned chain (an agent session's prefix between its turns, serve/sessions.py) holds a reference on
each of its pages and keeps the snapshot at its end until it is unpinned.

With DP attention (serve/cache.py) a request reads only its own data group's pages: each group's chains
start from their own root, so the same prefix cached in two groups is two entries, and eviction takes
the entries of the group that needs room.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np


@dataclasses.dataclass
class Entry:
    page: int
    refs: int = 0  # running requests and pins using the page
    snapshot: int | None = None  # slot holding the KDA state after this page
    pins: int = 0  # pinned chains ending here: the snapshot is not evicted


class PrefixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()  # LRU first
        self.by_page: dict[int, bytes] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    def chain(self, tokens: list[int], first: int, end: int, previous: bytes = b"") -> list[bytes]:
        """Hashes of full pages first..end-1 of `tokens`, continuing from the hash of page first-1."""
        return list(self._hashes(tokens, first, end, previous))

    def _hashes(self, tokens: list[int], first: int, end: int, previous: bytes):
        """`chain`, one hash at a time (a lookup that misses early stops hashing there)."""
        for i in range(first, end):
            page = np.asarray(tokens[i * self.page_size:(i + 1) * self.page_size], np.int64).tobytes()
            previous = hashlib.blake2b(previous + page, digest_size=16).digest()
            yield previous

    @staticmethod
    def root(group: int) -> bytes:
        """What the hash chain of a prompt cached in data `group` starts from."""
        return b"" if group == 0 else b"group %d" % group  # never 16 bytes long, as a page's hash is

    def lookup(self, prompt: list[int], restore=None, group: int = 0) -> tuple[list[bytes], list[int], int | None]:
        """The longest cached prefix of `prompt` in data `group` that ends at a snapshot and leaves at
        least one token to compute: (hashes, pages, snapshot slot); the pages are referenced for the
        caller. restore(chain, hit): the pages of the prompt's chain a host tier extends the device hit
        to (serve/kv_offload.py), cached and referenced again."""
        chain = self.chain(prompt, 0, (len(prompt) - 1) // self.page_size, self.root(group))
        hashes = self._referenced(chain)
        if restore is not None:
            hashes = chain[:restore(chain, len(hashes))]
        self.queried_tokens += len(prompt)
        self.hit_tokens += len(hashes) * self.page_size
        return hashes, [self.entries[h].page for h in hashes], self.entries[hashes[-1]].snapshot if hashes else None

    def cached_pages(self, prompt: list[int], group: int) -> int:
        """How many pages `lookup` would find for `prompt` in `group` on the device (nothing referenced).
        DP attention asks it of every group at admission: it hashes the prompt only as far as the
        group's cache holds it."""
        return self._usable(self._hashes(prompt, 0, (len(prompt) - 1) // self.page_size, self.root(group)))

    def _usable(self, hashes) -> int:
        """Length of the longest cached prefix of the chain `hashes` that ends at a snapshot."""
        usable = 0
        for i, h in enumerate(hashes):
            entry = self.entries.get(h)
            if entry is None:
                break
            if entry.snapshot is not None:
                usable = i + 1
        return usable

    def _referenced(self, hashes: list[bytes]) -> list[bytes]:
        """The longest cached prefix of the chain `hashes` that ends at a snapshot, its entries
        referenced (and made the most recently used)."""
        usable = self._usable(hashes)
        self.reference(hashes[:usable])
        return hashes[:usable]

    def reference(self, hashes: list[bytes]) -> None:
        """One more reference on each cached entry of `hashes`, made the most recently used."""
        for h in hashes:
            self.entries[h].refs += 1
            self.entries.move_to_end(h)

    def insert(self, h: bytes, page: int) -> bool:
        """Registers a request's newly filled page (it holds one reference); False if the prefix is
        already cached (under another page, which stays the cached one)."""
        if h in self.entries:
            return False
        self.entries[h] = Entry(page, refs=1)
        self.by_page[page] = h
        return True

    def holds(self, page: int) -> bool:
        return page in self.by_page

    def release(self, page: int) -> None:
        entry = self.entries[self.by_page[page]]
        entry.refs -= 1

    def wants_snapshot(self, h: bytes) -> bool:
        entry = self.entries.get(h)
        return entry is not None and entry.snapshot is None

    def set_snapshot(self, h: bytes, slot: int) -> None:
        self.entries[h].snapshot = slot

    def pin(self, hashes: list[bytes]) -> list[bytes]:
        """Pins the longest cached prefix of the chain `hashes` that ends at a snapshot (what a request
        with that prefix resumes from); returns the pinned hashes (none when no snapshot is cached)."""
        pinned = self._referenced(hashes)
        if pinned:
            self.entries[pinned[-1]].pins += 1
        return pinned

    def unpin(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.entries[h].refs -= 1
        self.entries[hashes[-1]].pins -= 1

    def drop_snapshot(self, h: bytes) -> int | None:
        """Takes the snapshot off entry `h` unless a pin protects it: its slot, or None."""
        entry = self.entries.get(h)
        if entry is None or entry.pins or entry.snapshot is None:
            return None
        slot, entry.snapshot = entry.snapshot, None
        return slot

    def evict(self, page_wanted=None) -> tuple[bytes, int, int | None] | None:
        """Drops the least recently used entry nobody references (whose page `page_wanted(page)` accepts,
        when given): (its hash, its page, its snapshot slot or None)."""
        for h, entry in self.entries.items():
            if entry.refs == 0 and (page_wanted is None or page_wanted(entry.page)):
                del self.entries[h]
                del self.by_page[entry.page]
                return h, entry.page, entry.snapshot
        return None

    def evict_snapshot(self, slot_wanted=None) -> tuple[bytes, int] | None:
        """Frees the least recently used snapshot slot no pin protects (and `slot_wanted(slot)` accepts,
        when given; a copy: requests that resumed from it hold their own state; the pages stay cached):
        (its entry's hash, the slot)."""
        for h, entry in self.entries.items():
            if entry.snapshot is not None and not entry.pins and (slot_wanted is None or slot_wanted(entry.snapshot)):
                slot, entry.snapshot = entry.snapshot, None
                return h, slot
        return None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
