"""DP attention's host side (serve/cache.py, serve/scheduler.py, serve/prefix_cache.py,
serve.runner.place): each data group's block of pages and slots, which group a request joins, and
where its row goes in a step. tests/serve/test_engine.py runs the engine so on 2x2 and 8x2 meshes
against the one-device reference, tests/serve/dspark/test_engine_dspark.py a speculative one on 2x2."""

import numpy as np
import pytest

from k3jax.config import K3Config
from serve.cache import CacheAllocator, CacheLayout, describe, engine_layout
from serve.engine import EngineOptions
from serve.prefix_cache import PrefixCache
from serve.runner import place, placed, request_order
from serve.sampling import SamplingParams
from serve.scheduler import Request, Scheduler, Status

PAGE = 4


def scheduler_of(groups: int, pages_per_group: int = 20, slots_per_group: int = 6, max_num_seqs: int = 4,
                 prefix_cache: bool = False) -> Scheduler:
    layout = CacheLayout(PAGE, pages_per_group * groups, slots_per_group * groups, groups)
    allocator = CacheAllocator(layout, PrefixCache(PAGE) if prefix_cache else None)
    return Scheduler(allocator, max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_prefill_chunk=64,
                     max_prefill_rows=4)


def request(name: str, length: int, first: int = 1) -> Request:
    return Request(name, list(range(first, first + length)), SamplingParams(), 0)


def in_own_group(scheduler: Scheduler, r: Request) -> bool:
    allocator = scheduler.allocator
    return allocator.group_of_slot(r.slot) == r.group and all(allocator.group_of_page(p) == r.group for p in r.pages)


def compute(scheduler: Scheduler, plan) -> None:
    """The step's bookkeeping by hand: chunks computed, full pages cached (with prefix caching)."""
    for r, chunk in plan.prefill:
        r.computed += chunk
        if scheduler.prefix_cache is not None:
            scheduler.register(r)


@pytest.mark.isa_invariant
def test_layout_gives_each_group_its_share_with_a_null_page_and_slot():
    cfg = K3Config.from_preset("k3-tiny")
    options = EngineOptions(max_model_len=64, max_num_seqs=5, block_size=PAGE, enable_prefix_caching=True)
    one = engine_layout(cfg, options, 4, 4, 0)
    two = engine_layout(cfg, options, 4, 4, 0, groups=2)
    assert (one.num_slots, one.num_pages) == (5 + 5 + 1, 5 * 16 + 1)
    # 3 requests and 3 snapshots a group (5 rounded up), each group with its own null page and slot
    assert (two.slots_per_group, two.pages_per_group, two.groups) == (3 + 3 + 1, 3 * 16 + 1, 2)
    assert (two.num_slots, two.num_pages) == (14, 98)
    # the plan the server logs: 48 usable pages a group hold 3 requests of 16 pages
    assert describe(two, page_bytes=2**20, slot_bytes=2**19, max_model_len=64) == (
        "48 MLA pages of 4 tokens (48.0 MiB) and 6 KDA slots (3.0 MiB) per data group, 2 group(s): "
        "6 requests of max_model_len=64 fit at once")

    allocator = CacheAllocator(two)
    pages = allocator.allocate_pages(48, group=1)
    assert sorted(pages) == list(range(50, 98))  # group 1's block without its null page 49
    assert allocator.allocate_pages(1, group=1) is None and allocator.free_pages_in(0) == 48
    slots = [allocator.allocate_slot(0) for _ in range(6)]
    assert sorted(slots) == list(range(1, 7)) and allocator.allocate_slot(0) is None
    allocator.free(pages[:2], slots[0])
    assert (allocator.free_pages_in(1), allocator.free_slots_in(0), allocator.free_pages_in(0)) == (2, 1, 48)


@pytest.mark.isa_invariant
def test_requests_spread_over_groups_and_preempt_only_their_own_group():
    scheduler = scheduler_of(2, pages_per_group=9)
    requests = [request(f"r{i}", n, first=100 * i) for i, n in enumerate([16, 16, 16, 4])]
    for r in requests:
        scheduler.add(r)
    plan = scheduler.schedule()
    assert [r.group for r, _ in plan.prefill] == [0, 1, 0, 1]  # most free pages first
    assert all(in_own_group(scheduler, r) for r in requests)
    compute(scheduler, plan)
    for _ in range(12):  # decode until group 0 (8 usable pages, both full at 16 tokens) runs out
        for r in scheduler.running:
            r.output.append(0)  # the step's sampled token
        for r in scheduler.schedule().decode:
            r.computed += 1
        assert all(in_own_group(scheduler, r) for r in scheduler.running)
        if scheduler.num_preemptions:
            break
    # the victim is the latest admitted request of the group short of a page, not the latest of all (r3)
    assert [r.id for r in requests if r.num_preemptions] == ["r2"]


@pytest.mark.isa_invariant
def test_a_prompt_joins_the_group_that_cached_its_prefix_and_hits_only_there():
    scheduler = scheduler_of(2, prefix_cache=True)
    cache = scheduler.prefix_cache
    blocker = request("blocker", 8, first=500)  # in group 0: the cached prompt goes to group 1
    scheduler.add(blocker)
    compute(scheduler, scheduler.schedule())
    first = request("first", 21)
    scheduler.add(first)
    plan = scheduler.schedule()
    assert first.group == 1
    compute(scheduler, plan)
    scheduler.finish(first, "stop")
    assert cache.cached_pages(list(range(1, 30)), 1) == 5 and cache.cached_pages(list(range(1, 30)), 0) == 0

    again = request("again", 29)  # group 0 has more free pages, but group 1 holds 5 of its pages
    scheduler.add(again)
    scheduler.schedule()
    assert again.group == 1 and again.computed == 5 * PAGE and in_own_group(scheduler, again)
    # the same prefix in group 0 is an entry of its own: group 1's pages are never read from group 0
    hashes, pages, snapshot = cache.lookup(list(range(1, 30)), group=0)
    assert hashes == pages == [] and snapshot is None


@pytest.mark.isa_invariant
def test_rows_are_placed_in_their_groups_blocks():
    assert place([0, 1, 2], 1, (1, 2, 4)) == ([0, 1, 2], 4)
    assert place([1, 0, 1, 1], 2, (2, 4, 8)) == ([4, 0, 5, 6], 8)  # group 1's three rows need blocks of 4
    assert place([0, 1], 2, (2, 4)) == ([0, 1], 2)
    assert place([], 2, (2, 4)) == ([], 2)
    # a verify step's outputs back in request order, and request-ordered arrays out to the placed rows
    positions = [4, 0, 5, 6]
    order = request_order(positions, 8)
    assert order.tolist() == [4, 0, 5, 6, 1, 2, 3, 7]
    rows = np.arange(8) * 10  # a placed step's output per row
    assert rows[order][:4].tolist() == [40, 0, 50, 60]
    assert placed(np.array([1, 2, 3, 4, 0, 0, 0, 0]), positions).tolist() == [2, 0, 0, 0, 1, 3, 4, 0]
    assert placed(np.array([7, 8]), None).tolist() == [7, 8]

