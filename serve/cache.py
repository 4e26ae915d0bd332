"""The hybrid cache's host-side bookkeeping: which MLA pages and KDA slots each request holds.

The device pools (`k3jax.decoder.init_pools`) hold, per MLA layer, `num_pages` pages of `page_size`
latent rows and, per KDA layer, `num_slots` fp32 recurrent states with their conv windows. Page 0 and
slot 0 are the null page and slot that padding rows point at, so they are never handed out. One
memory budget is split between the two: every running request needs one slot, and pages as its
context grows.

DP attention: on a mesh with data > 1 the pools split into `groups` equal blocks, one per data group
(serve/runner.py). A request's slot and pages all lie in one group's block, and each block's first
page and slot are that group's null page and slot. Ids stay global here; the runner makes them local
to the group for the step.
"""

from __future__ import annotations

import dataclasses
import math


from k3jax.config import KDA, MLA, K3Config


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Sizes of the pools: `num_slots` and `num_pages` include the null slot and page of each of the
    `groups` data groups (DP attention), which hold equal shares."""

    page_size: int
    num_pages: int
    num_slots: int
    groups: int = 1

    @property
    def pages_per_group(self) -> int:
        return self.num_pages // self.groups

    @property
    def slots_per_group(self) -> int:
        return self.num_slots // self.groups

    @staticmethod
    def from_budget(cfg: K3Config, *, memory_bytes: int, max_num_seqs: int, page_size: int,
                    dtype_bytes: int, kv_cache_dtype_bytes: int, draft_page_bytes: int = 0) -> "CacheLayout":
        """Slots for `max_num_seqs` requests, then as many pages as the rest of `memory_bytes` holds
        (`draft_page_bytes`: what a speculative draft keeps per page beside the target's MLA rows)."""
        slots = max_num_seqs + 1
        per_page = page_bytes(cfg, page_size, kv_cache_dtype_bytes) + draft_page_bytes
        pages = (memory_bytes - slots * slot_bytes(cfg, dtype_bytes)) // per_page
        if pages < 2:
            raise ValueError(f"a cache budget of {memory_bytes} bytes holds {max_num_seqs} KDA slots but not a "
                             f"single {page_size}-token MLA page; raise the budget or lower max_num_seqs")
        return CacheLayout(page_size, int(pages), slots)


def engine_layout(cfg: K3Config, options, dtype_bytes: int, kv_bytes: int, draft_page_bytes: int,
                  groups: int = 1, free_bytes: int | None = None) -> CacheLayout:
    """The pools of an engine with `options` (serve.engine.EngineOptions): a slot per request and per
    prefix-cache snapshot, and the pages `num_gpu_blocks`, `kv_cache_memory_bytes` or, by default, a
    full-length request per slot make, as far as `free_bytes` (a data group's share of the free device
    memory, `free_cache_bytes`) holds them. With `groups` data groups (DP attention) each group gets its
    share of max_num_seqs and of the snapshots, rounded up, and the pages that share makes; the page
    count and the memory budget are per group, as they are per device in vLLM."""
    seqs = -(-options.max_num_seqs // groups)
    snapshots = 0
    if options.enable_prefix_caching:
        snapshots = options.max_num_seqs if options.num_snapshot_slots is None else options.num_snapshot_slots
        snapshots = -(-snapshots // groups)
    slots = seqs + snapshots + 1
    min_pages = -(-options.max_model_len // options.block_size) + 1  # one full-length request, and the null page
    per_page = page_bytes(cfg, options.block_size, kv_bytes) + draft_page_bytes
    where = "the cache budget"
    if options.num_gpu_blocks is not None:
        pages = options.num_gpu_blocks
    elif options.kv_cache_memory_bytes is not None:
        pages = CacheLayout.from_budget(cfg, memory_bytes=options.kv_cache_memory_bytes,
                                        max_num_seqs=slots - 1, page_size=options.block_size,
                                        dtype_bytes=dtype_bytes, kv_cache_dtype_bytes=kv_bytes,
                                        draft_page_bytes=draft_page_bytes).num_pages
    else:  # every slot can hold a full-length request, as far as the free memory goes
        pages = seqs * (min_pages - 1) + 1
        if free_bytes is not None:
            fit = (free_bytes - slots * slot_bytes(cfg, dtype_bytes)) // per_page
            if fit < pages:
                pages, where = max(int(fit), 0), f"the {free_bytes} bytes of device memory free for the cache"
    if pages < min_pages:
        raise ValueError(f"{pages} pages of {options.block_size} tokens ({pages * per_page} bytes, {where}) cannot "
                         f"hold one request of max_model_len={options.max_model_len} ({min_pages - 1} pages); "
                         "lower max_model_len or max_num_seqs, store the pages in fp8 (kv_cache_dtype), "
                         "or give the cache more memory")
    return CacheLayout(options.block_size, pages * groups, slots * groups, groups)


# The share of the free memory the pools take by default: the rest stays for the step's activations and
# the compiled programs' scratch (vLLM keeps 10% of the device too, with gpu_memory_utilization 0.9).
CACHE_SHARE = 0.9


def free_cache_bytes(devices) -> int | None:
    """What one data group's pools may take by default: CACHE_SHARE of the least free memory among
    `devices` (an accelerator's allocator limit less what it holds, the weights already loaded), or on
    CPU devices, which share the host's memory, of the host's available memory over the number of
    devices (each holds its group's pages). None where neither is known."""
    devices = list(devices)
    stats = [device.memory_stats() for device in devices]
    if all(stats) and all("bytes_limit" in s for s in stats):
        return int(CACHE_SHARE * min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats))
    if all(device.platform == "cpu" for device in devices):
        available = _host_available_bytes()
        return None if available is None else int(CACHE_SHARE * available / len(devices))
    return None


def _host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def describe(layout: CacheLayout, *, page_bytes: int, slot_bytes: int, max_model_len: int) -> str:
    """The memory plan of the pools in a line (`python -m k3jax.serve` logs it before allocating them)."""
    pages, slots = layout.pages_per_group - 1, layout.slots_per_group - 1  # without the null ones
    full = math.ceil(max_model_len / layout.page_size)
    mib = 2 ** 20
    return (f"{pages} MLA pages of {layout.page_size} tokens ({pages * page_bytes / mib:.1f} MiB) and {slots} KDA "
            f"slots ({slots * slot_bytes / mib:.1f} MiB) per data group, {layout.groups} group(s): "
            f"{pages // full * layout.groups} requests of max_model_len={max_model_len} fit at once")


def page_bytes(cfg: K3Config, page_size: int, kv_cache_dtype_bytes: int) -> int:
    """Bytes of one page over every MLA layer."""
    return cfg.layer_types.count(MLA) * page_size * cfg.mla_cache_width * kv_cache_dtype_bytes


def slot_bytes(cfg: K3Config, dtype_bytes: int) -> int:
    """Bytes of one slot over every KDA layer: fp32 state and the conv window in the activation dtype."""
    state = cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4
    conv = (cfg.kda_conv_size - 1) * 3 * cfg.kda_projection_size * dtype_bytes
    return cfg.layer_types.count(KDA) * (state + conv)


class CacheAllocator:
    """Free lists of pages and slots, one pair per data group. Allocation is all-or-nothing. With a
    prefix cache, pages it holds are released to it rather than freed, and its unused entries of the
    group are evicted (least recently used first) when the group's free lists run dry."""

    def __init__(self, layout: CacheLayout, prefix_cache=None, offload=None):
        """offload: the prefix cache's host tier (serve/kv_offload.py), which keeps what it evicts."""
        self.layout = layout
        self.prefix_cache = prefix_cache
        self.offload = offload
        pages, slots = layout.pages_per_group, layout.slots_per_group
        # each group's block without its null entry; pop() hands out low ids first
        self._free_pages = [list(range((g + 1) * pages - 1, g * pages, -1)) for g in range(layout.groups)]
        self._free_slots = [list(range((g + 1) * slots - 1, g * slots, -1)) for g in range(layout.groups)]

    @property
    def free_pages(self) -> int:
        return sum(map(len, self._free_pages))

    @property
    def free_slots(self) -> int:
        return sum(map(len, self._free_slots))

    def free_pages_in(self, group: int) -> int:
        return len(self._free_pages[group])

    def free_slots_in(self, group: int) -> int:
        return len(self._free_slots[group])

    def group_of_page(self, page: int) -> int:
        return page // self.layout.pages_per_group

    def group_of_slot(self, slot: int) -> int:
        return slot // self.layout.slots_per_group

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.layout.page_size)

    def allocate_slot(self, group: int = 0) -> int | None:
        free = self._free_slots[group]
        if not free and self.prefix_cache is not None:
            evicted = self.prefix_cache.evict_snapshot(lambda slot: self.group_of_slot(slot) == group)
            if evicted is not None:
                if self.offload is not None:
                    self.offload.stage(evicted[0], None, evicted[1])
                return evicted[1]
        return free.pop() if free else None

    def allocate_pages(self, count: int, group: int = 0) -> list[int] | None:
        free = self._free_pages[group]
        while count > len(free) and self.prefix_cache is not None:
            evicted = self.prefix_cache.evict(lambda page: self.group_of_page(page) == group)
            if evicted is None:
                break
            if self.offload is not None:
                self.offload.stage(*evicted)
            self._return(*evicted[1:])
        if count > len(free):
            return None
        return [free.pop() for _ in range(count)]

    def free(self, pages: list[int], slot: int | None) -> None:
        for page in reversed(pages):
            if self.prefix_cache is not None and self.prefix_cache.holds(page):
                self.prefix_cache.release(page)
            else:
                self._free_pages[self.group_of_page(page)].append(page)
        if slot is not None:
            if self.offload is not None:
                self.offload.release_slot(slot)
            self._free_slots[self.group_of_slot(slot)].append(slot)

    def reset_prefix_cache(self) -> None:
        """Evicts every cached page and snapshot nobody is using, and forgets the host tier's."""
        while (evicted := self.prefix_cache.evict()) is not None:
            self._return(*evicted[1:])
        while (evicted := self.prefix_cache.evict_snapshot()) is not None:
            self._free_slots[self.group_of_slot(evicted[1])].append(evicted[1])
        if self.offload is not None:
            self.offload.clear()

    def restore(self, chain: list[bytes], hit: int, slot: int) -> int:
        """The pages of `chain` a prefix-cache lookup for the request of `slot` hits: its device hit,
        extended from the host tier."""
        return hit if self.offload is None else self.offload.restore(chain, hit, self, slot)

    def _return(self, page: int, snapshot: int | None) -> None:
        self._free_pages[self.group_of_page(page)].append(page)
        if snapshot is not None:
            self._free_slots[self.group_of_slot(snapshot)].append(snapshot)
