"""KV offload: a host-memory tier under the prefix cache (vLLM's --kv-offloading-size).

When the prefix cache evicts a page (LRU) or the KDA snapshot of a page, its contents (the page's
rows in every MLA layer, as stored: fp8 pages stay fp8, and the pool's per-layer scale, fixed for
the engine's life, still applies; the snapshot's state and conv window in every KDA layer) are
copied into NumPy arrays keyed by the same page hash, least recently offloaded dropped first when
the tier passes `budget_bytes`. A later lookup whose hash chain goes on past its device hit through
host entries, up to a page with a snapshot on either side, takes device pages for the host's pages
and brings them back (a host snapshot goes straight into the request's own slot), so the request
resumes there instead of recomputing. If the pool cannot give the pages, the lookup keeps its device
hit and the rest is recomputed, as without the tier.

Evictions happen while the scheduler allocates; the freed page or slot is written only by a later
runner call. So the copies are staged and `transfer` runs before the runner writes the pools: jitted
gathers bring every staged page and snapshot to the host, then, before a step, jitted scatters write
every restored page and snapshot into its page or slot (a page restored and evicted again before
that goes back to the host without touching the device). Pages and slots have programs of their
own, one per power-of-two count, compiled at warm-up (`compile_transfers`). The same programs move a
prefill's cache between engines (`Runner.read_state` / `write_state`, serve/disagg).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.kda import KDACache
from k3jax.layers.mla import MLAPages


@dataclasses.dataclass
class HostEntry:
    page: np.ndarray | None = None  # [MLA layers, page_size, width], the pool's dtype
    snapshot: tuple[np.ndarray, np.ndarray] | None = None  # conv [KDA layers, ...], state [KDA layers, ...]

    @property
    def nbytes(self) -> int:
        return (0 if self.page is None else self.page.nbytes) + \
            (0 if self.snapshot is None else sum(a.nbytes for a in self.snapshot))


@jax.jit
def gather_pages(pools, pages):
    """The pages' rows in every MLA layer [n, MLA layers, page_size, width]."""
    return jnp.stack([pool.pages[pages] for pool in pools if isinstance(pool, MLAPages)], 1)


@jax.jit
def gather_slots(pools, slots):
    """The slots' conv windows and states, every KDA layer: [n, KDA layers, ...] each."""
    kda = [pool for pool in pools if isinstance(pool, KDACache)]
    return jnp.stack([pool.conv[slots] for pool in kda], 1), jnp.stack([pool.state[slots] for pool in kda], 1)


@functools.partial(jax.jit, donate_argnums=0)
def scatter_pages(pools, pages, rows):
    """Writes `gather_pages`' layout back: rows[n] into page pages[n]."""
    out, m = [], 0
    for pool in pools:
        if isinstance(pool, MLAPages):
            pool, m = pool._replace(pages=pool.pages.at[pages].set(rows[:, m])), m + 1
        out.append(pool)
    return tuple(out)


@functools.partial(jax.jit, donate_argnums=0)
def scatter_slots(pools, slots, conv, state):
    """Writes `gather_slots`' layout back: conv[n] and state[n] into slot slots[n]."""
    out, k = [], 0
    for pool in pools:
        if isinstance(pool, KDACache):
            pool, k = KDACache(pool.conv.at[slots].set(conv[:, k]), pool.state.at[slots].set(state[:, k])), k + 1
        out.append(pool)
    return tuple(out)


def compile_transfers(pool_specs, max_pages: int, max_slots: int, sharding) -> None:
    """Compiles the four programs for every padded count of pages up to max_pages and of slots up to
    max_slots, without running them (`pool_specs`: the pools' shapes and shardings; `sharding`: where
    the scatters' rows, conv windows and states are placed, whole on each of the pools' devices), so
    no transfer compiles while serving."""
    mla = [pool.pages for pool in pool_specs if isinstance(pool, MLAPages)]
    kda = [pool for pool in pool_specs if isinstance(pool, KDACache)]
    for n in _counts(max_pages):
        pages = np.zeros(n, np.int32)
        gather_pages.lower(pool_specs, pages).compile()
        rows = jax.ShapeDtypeStruct((n, len(mla), *mla[0].shape[1:]), mla[0].dtype, sharding=sharding)
        scatter_pages.lower(pool_specs, pages, rows).compile()
    for n in _counts(max_slots):
        slots = np.zeros(n, np.int32)
        gather_slots.lower(pool_specs, slots).compile()
        conv, state = (jax.ShapeDtypeStruct((n, len(kda), *a.shape[1:]), a.dtype, sharding=sharding)
                       for a in (kda[0].conv, kda[0].state))
        scatter_slots.lower(pool_specs, slots, conv, state).compile()


def _stacked(arrays: list[np.ndarray]) -> np.ndarray:
    """Same-shaped arrays stacked and padded with zeros to `padded`'s length, in one copy (the padding
    writes the null page or slot 0)."""
    out = np.zeros((padded_length(len(arrays)), *arrays[0].shape), arrays[0].dtype)
    for i, array in enumerate(arrays):
        out[i] = array
    return out


def _counts(largest: int) -> list[int]:
    """The lengths `padded` gives for 1 to `largest` indices."""
    return [1 << k for k in range(padded_length(largest).bit_length())]


def padded_length(count: int) -> int:
    """A count of indices padded to a power of two (one compile per size)."""
    return 1 << max(count - 1, 0).bit_length()


def padded(indices: list[int]) -> np.ndarray:
    """int32 indices padded with the null page or slot 0 to `padded_length`."""
    out = np.zeros(padded_length(len(indices)), np.int32)
    out[:len(indices)] = indices
    return out


class KVOffload:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: collections.OrderedDict[bytes, HostEntry] = collections.OrderedDict()  # oldest first
        self.nbytes = 0
        self._gather_pages: list[tuple[bytes, int]] = []  # evicted, still to copy out
        self._gather_slots: list[tuple[bytes, int]] = []
        self._scatter_pages: dict[int, tuple[bytes, np.ndarray]] = {}  # restored, still to copy in
        self._scatter_slots: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # request slot -> snapshot
        self.offloaded_pages = self.offloaded_snapshots = self.restored_pages = self.restored_snapshots = 0

    @property
    def pending(self) -> bool:
        return bool(self._gather_pages or self._gather_slots or self._scatter_pages or self._scatter_slots)

    def stage(self, h: bytes, page: int | None, slot: int | None) -> None:
        """The prefix cache evicted page `page` and/or snapshot slot `slot` of entry `h`."""
        if page is not None:
            if page in self._scatter_pages:  # restored, never written: its contents are still on the host side
                self._put(h, page=self._scatter_pages.pop(page)[1])
            else:
                self._gather_pages.append((h, page))
        if slot is not None:  # a snapshot slot: restores only write requests' slots
            self._gather_slots.append((h, slot))

    def restore(self, chain: list[bytes], hit: int, allocator, slot: int) -> int:
        """Extends a device hit of the first `hit` pages of `chain` (the prefix cache's hash chain of a
        prompt, its hit referenced) through host entries up to the last page with a snapshot on the
        device or the host: the pages are cached and referenced again, their copies staged, and a host
        snapshot at the end is staged into the request's `slot` (a snapshot slot taken now could be one
        an earlier admission of this step is about to copy from; the host keeps the snapshot). Returns
        the pages hit."""
        cache = allocator.prefix_cache
        end = hit
        for i, h in enumerate(chain[hit:], hit):
            entry, host = cache.entries.get(h), self.entries.get(h)
            if entry is None and (host is None or host.page is None):
                break
            if (entry is not None and entry.snapshot is not None) or (host is not None and host.snapshot is not None):
                end = i + 1
        if end == hit:
            return hit
        resident = [h for h in chain[hit:end] if h in cache.entries]
        cache.reference(resident)  # before allocating, which could evict them
        missing = [h for h in chain[hit:end] if h not in cache.entries]
        pages = allocator.allocate_pages(len(missing), allocator.group_of_slot(slot))
        if pages is None:  # the pool is full: recompute past the device hit
            allocator.free([cache.entries[h].page for h in resident], None)
            return hit
        for h, page in zip(missing, pages):
            cache.insert(h, page)  # referenced for the request, like a hit
            self._scatter_pages[page] = (h, self._take_page(h))
        self.restored_pages += len(missing)
        if cache.entries[chain[end - 1]].snapshot is None:  # else the request copies the device's
            self._scatter_slots[slot] = self.entries[chain[end - 1]].snapshot
            self.restored_snapshots += 1
        return end

    def release_slot(self, slot: int) -> None:
        """A request gave its slot back before its restored snapshot landed: the slot's next user must
        not get it."""
        self._scatter_slots.pop(slot, None)

    def transfer(self, pools, sharding, restores: bool = True):
        """Copies the staged evictions to the host, then (with `restores`) the staged restores into the
        pools, placed by `sharding` (`compile_transfers`'); returns the pools."""
        if self._gather_pages or self._gather_slots:
            pages, slots = self._gather_pages, self._gather_slots
            self._gather_pages, self._gather_slots = [], []
            rows, (conv, state) = jax.device_get((
                gather_pages(pools, padded([p for _, p in pages])) if pages else None,
                gather_slots(pools, padded([s for _, s in slots])) if slots else (None, None)))
            for i, (h, _) in enumerate(pages):
                self._put(h, page=rows[i].copy())  # a copy: the batch's array is not kept alive by one entry
            for i, (h, _) in enumerate(slots):
                self._put(h, snapshot=(conv[i].copy(), state[i].copy()))
            self.offloaded_pages += len(pages)
            self.offloaded_snapshots += len(slots)
        while self.nbytes > self.budget_bytes:  # the least recently offloaded go first
            self.nbytes -= self.entries.popitem(last=False)[1].nbytes
        if restores and self._scatter_pages:
            rows = jax.device_put(_stacked([page for _, page in self._scatter_pages.values()]), sharding)
            pools = scatter_pages(pools, padded(list(self._scatter_pages)), rows)
            self._scatter_pages = {}
        if restores and self._scatter_slots:
            conv, state = jax.device_put([_stacked(arrays) for arrays in zip(*self._scatter_slots.values())], sharding)
            pools = scatter_slots(pools, padded(list(self._scatter_slots)), conv, state)
            self._scatter_slots = {}
        return pools

    def clear(self) -> None:
        """Forgets every host entry and staged copy (the prefix cache was reset: the pages are free)."""
        self.entries.clear()
        self.nbytes = 0
        self._gather_pages, self._gather_slots, self._scatter_pages, self._scatter_slots = [], [], {}, {}

    def stats(self) -> dict:
        return {"kv_offload_bytes": self.nbytes, "kv_offload_entries": len(self.entries),
                "kv_offloaded_pages": self.offloaded_pages, "kv_offloaded_snapshots": self.offloaded_snapshots,
                "kv_restored_pages": self.restored_pages, "kv_restored_snapshots": self.restored_snapshots}

    def _put(self, h: bytes, *, page=None, snapshot=None) -> None:
        """Stores a page or a snapshot under `h` as the most recent entry (`transfer` trims to the budget,
        so no entry a lookup is restoring from goes meanwhile)."""
        entry = self.entries.pop(h, None) or HostEntry()
        self.nbytes -= entry.nbytes
        entry.page = page if page is not None else entry.page
        entry.snapshot = snapshot if snapshot is not None else entry.snapshot
        self.entries[h] = entry
        self.nbytes += entry.nbytes

    def _take_page(self, h: bytes) -> np.ndarray:
        """Removes the page of host entry `h` (going back to the device) and returns it."""
        entry = self.entries[h]
        self.nbytes -= entry.nbytes
        page, entry.page = entry.page, None
        if entry.snapshot is None:
            del self.entries[h]
        else:
            self.nbytes += entry.nbytes
        return page
