"""How many pages the engine's pools get by default: a full-length request per slot, as far as the
free device memory goes (serve.cache.engine_layout, free_cache_bytes); a clear refusal where not even
one request of max_model_len fits. Host side only: nothing is allocated or compiled."""

import types

import jax
import pytest

from k3jax.config import K3Config
from serve import cache
from serve.cache import CACHE_SHARE, engine_layout, free_cache_bytes, page_bytes, slot_bytes
from serve.engine import EngineOptions

pytestmark = pytest.mark.isa_invariant

CFG = K3Config.from_preset("k3-tiny")
MILLION = EngineOptions(max_model_len=1 << 20, max_num_seqs=16, block_size=16)  # 65536 pages a request
PAGE, SLOT = page_bytes(CFG, 16, 2), slot_bytes(CFG, 2)


def layout(options, free_bytes, groups=1):
    return engine_layout(CFG, options, 2, 2, 0, groups, free_bytes)


def test_the_default_pool_shrinks_to_the_free_memory():
    full = 16 * 65536 + 1  # every slot a full-length request, and the null page
    assert layout(MILLION, None).num_pages == full  # nothing known: the default as before
    assert layout(MILLION, 10 * full * PAGE).num_pages == full  # ample: unchanged
    free = 3 * 65536 * PAGE + 17 * SLOT + 5 * PAGE  # three requests' pages, the slots, a little more
    assert layout(MILLION, free).num_pages == 3 * 65536 + 5
    # DP attention: the free memory is a group's (its block lies on its own devices), and a group holds
    # 8 requests' slots and the null one, 8 fewer than the 17 above
    two = layout(MILLION, free, groups=2)
    assert (two.pages_per_group, two.groups) == (3 * 65536 + 5 + 8 * SLOT // PAGE, 2)


def test_an_explicit_page_count_or_budget_is_not_capped():
    free = 2 * 65536 * PAGE
    assert layout(EngineOptions(**{**vars(MILLION), "num_gpu_blocks": 4 * 65536 + 1}), free).num_pages == 4 * 65536 + 1
    budget = EngineOptions(**{**vars(MILLION), "kv_cache_memory_bytes": 4 * 65536 * PAGE + 17 * SLOT})
    assert layout(budget, free).num_pages == 4 * 65536


def test_a_max_model_len_the_memory_cannot_hold_is_refused_by_name():
    with pytest.raises(ValueError, match=r"bytes of device memory free for the cache\) cannot hold one request of "
                                         r"max_model_len=1048576 \(65536 pages\)"):
        layout(MILLION, 65536 * PAGE)  # the slots take their share first: one page short
    assert layout(MILLION, 65537 * PAGE + 17 * SLOT).num_pages == 65537


def test_free_bytes_come_from_the_allocator_or_the_host(monkeypatch):
    gpu = [types.SimpleNamespace(platform="gpu", memory_stats=lambda used=used: {"bytes_limit": 100 << 30,
                                                                                 "bytes_in_use": used})
           for used in (40 << 30, 60 << 30)]
    assert free_cache_bytes(gpu) == int(CACHE_SHARE * (40 << 30))  # the fullest device bounds its group
    monkeypatch.setattr(cache, "_host_available_bytes", lambda: 16 << 30)
    cpus = jax.devices()[:1]
    assert free_cache_bytes(cpus) == int(CACHE_SHARE * (16 << 30))
    fake = [types.SimpleNamespace(platform="cpu", memory_stats=lambda: None)] * 4  # fake devices share the host
    assert free_cache_bytes(fake) == int(CACHE_SHARE * (4 << 30))
    monkeypatch.setattr(cache, "_host_available_bytes", lambda: None)
    assert free_cache_bytes(cpus) is None


def test_the_host_reports_its_available_memory():
    available = cache._host_available_bytes()
    assert available is None or 0 < available <= _total_memory()


def _total_memory() -> int:
    with open("/proc/meminfo") as meminfo:
        return int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1]) * 1024
