"""KV offload (serve/kv_offload.py): the prefix cache's evicted pages and KDA snapshots kept in host
memory and brought back on a later hit instead of recomputed.

A 60-token prompt is run, then other traffic touches more new pages than the pool holds, so its
pages and snapshot are evicted. Run again, it must restore its 14 full pages up to its snapshot from
the host and compute only the last 4 prompt tokens (the engine's prompt-token counter), and its
tokens and logprobs must be those of the same request whose prefix stayed on the device (an engine
without the tier, run twice in a row), and the reference's (tests/agreement.py). Without the tier
(budget 0) the same sequence recomputes every prompt token. The tier's budget drops the least
recently offloaded entries first, counted in bytes against the pool's page and slot sizes from the
config; a lookup whose restore the full pool cannot take recomputes instead; fp8 pages go to the host
as stored and come back to give the fp8 device hit's numbers. An engine warmed up compiles nothing
while it offloads and restores.
"""

import jax
import numpy as np
import pytest

from k3jax.decoder import init_pools
from k3jax.layers.kda import KDACache
from k3jax.layers.mla import MLAPages
from serve.cache import page_bytes, slot_bytes
from serve.engine import Engine, EngineOptions
from serve.kv_offload import KVOffload
from serve.sampling import SamplingParams
from tests.serve.test_engine import CountCompiles, assert_pool_full, model, referee  # noqa: F401

PAGE, PAGES = 4, 48  # with the null page: 47 usable, fewer than the other traffic touches
OPTIONS = dict(max_model_len=96, max_num_seqs=2, max_num_batched_tokens=24, max_prefill_chunk=16,
               max_prefill_rows=2, block_size=PAGE, num_gpu_blocks=PAGES, enable_prefix_caching=True)
PROMPT = 60  # (60 - 1) // 4 = 14 full pages before the last token; the snapshot is at the 14th


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def other_traffic(engine, rng):
    """Four 50-token prompts of their own: 56 new pages, more than the pool, so every page cached before is evicted."""
    engine.generate([rng.integers(0, 512, 50).tolist() for _ in range(4)], [greedy(4)] * 4)


def run(engine, prompt):
    """(output, prompt tokens computed, host pages restored) of the prompt run alone."""
    before = engine.stats()
    out = engine.generate([prompt], [greedy(8)])[0]
    after = engine.stats()
    return (out, after["num_computed_prompt_tokens"] - before["num_computed_prompt_tokens"],
            after.get("kv_restored_pages", 0) - before.get("kv_restored_pages", 0))


@pytest.fixture(scope="module")
def engines(model):  # noqa: F811
    engines = {budget: Engine(model, EngineOptions(**OPTIONS, kv_offload_bytes=budget)) for budget in (0, 1 << 30)}
    engines[1 << 30].warmup(background=True).join()  # the transfers compile last, on the thread
    return engines


def test_an_evicted_prefix_is_restored_from_host_not_recomputed(engines, referee):  # noqa: F811
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 512, PROMPT).tolist()
    full = (PROMPT - 1) // PAGE  # pages up to the snapshot

    plain = engines[0]  # the same request with its prefix still on the device: the reference path
    run(plain, prompt)
    on_device, computed, _ = run(plain, prompt)
    assert on_device.num_cached_tokens == full * PAGE and computed == PROMPT - full * PAGE
    other_traffic(plain, np.random.default_rng(1))
    recomputed, computed, restored = run(plain, prompt)
    assert (recomputed.num_cached_tokens, computed, restored) == (0, PROMPT, 0)  # no tier: all of it again

    offload = engines[1 << 30]
    with CountCompiles() as compiles:  # warmed up: offloads and restores included
        cold, computed, _ = run(offload, prompt)
        assert computed == PROMPT
        other_traffic(offload, np.random.default_rng(1))
        assert offload.prefix_cache.lookup(prompt)[0] == []  # evicted from the device: only the host has it
        stats = offload.stats()
        assert stats["kv_offloaded_pages"] >= full and stats["kv_offloaded_snapshots"] >= 1
        restored_out, computed, restored = run(offload, prompt)
    assert compiles.count == 0
    assert (restored, computed, restored_out.num_cached_tokens) == (full, PROMPT - full * PAGE, full * PAGE)
    assert offload.stats()["kv_restored_snapshots"] == stats["kv_restored_snapshots"] + 1
    assert restored_out.token_ids == on_device.token_ids
    assert restored_out.logprobs == on_device.logprobs  # the same pages and state: the same numbers
    referee.check_all([prompt] * 3, [o.token_ids for o in (restored_out, recomputed, cold)],
                      [o.logprobs for o in (restored_out, recomputed, cold)])
    for engine in engines.values():
        assert_pool_full(engine)
    assert offload.stats()["kv_offload_bytes"] == 0  # a reset forgets the host tier too


def test_a_restore_the_full_pool_cannot_take_recomputes(model, referee):  # noqa: F811
    # 29 usable pages: with the long request's 20 held, fewer than the prompt's 14 are left to restore into
    engine = Engine(model, EngineOptions(**{**OPTIONS, "num_gpu_blocks": 30}, kv_offload_bytes=1 << 30))
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 512, PROMPT).tolist()
    run(engine, prompt)
    other_traffic(engine, rng)
    # a long request holds most of the pool: 80 prompt tokens and 12 out, 20 pages now and 3 later
    long_id = engine.add_request(rng.integers(0, 512, 80).tolist(), greedy(12))
    while engine.requests[long_id].pending != 1:
        engine.step()
    assert engine.allocator.free_pages + sum(e.refs == 0 for e in engine.prefix_cache.entries.values()) \
        < (PROMPT - 1) // PAGE  # fewer than the restore needs
    before = engine.stats()
    request_id = engine.add_request(prompt, greedy(8))
    engine.step()
    request = engine.requests[request_id]
    assert request.num_cached_tokens == 0 and request.computed > 0  # admitted, computing from the start
    assert engine.stats()["kv_restored_pages"] == before["kv_restored_pages"]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    referee.check_all([prompt], [outputs[request_id].token_ids], [outputs[request_id].logprobs])
    assert_pool_full(engine)


def test_the_host_budget_drops_the_oldest_entries_first(model):  # noqa: F811
    cfg = model.config
    pools = init_pools(cfg, num_slots=4, num_pages=16, page_size=PAGE, dtype=jax.numpy.float32)
    rng = np.random.default_rng(3)
    pools = tuple(MLAPages(jax.numpy.asarray(rng.standard_normal(p.pages.shape, np.float32)), p.scale)
                  if isinstance(p, MLAPages) else
                  KDACache(*(jax.numpy.asarray(rng.standard_normal(a.shape, np.float32)) for a in p)) for p in pools)
    expected_page = page_bytes(cfg, PAGE, 4)  # the sizes the cache budget uses, from the config alone
    expected_slot = slot_bytes(cfg, 4)
    tier = KVOffload(budget_bytes=5 * expected_page + expected_slot)
    hashes = [bytes([i]) * 16 for i in range(8)]
    for i, h in enumerate(hashes[:7]):  # pages 1..7 evicted oldest first, the last with its snapshot in slot 2
        tier.stage(h, i + 1, 2 if i == 6 else None)
    pools = tier.transfer(pools, jax.sharding.make_single_device_sharding(jax.local_devices()[0]))
    assert list(tier.entries) == hashes[2:7]  # 7 pages and a slot over a budget of 5 and a slot: the 2 oldest go
    assert tier.nbytes == 5 * expected_page + expected_slot == sum(e.nbytes for e in tier.entries.values())
    host = jax.device_get(pools)
    mla = [p.pages for p in host if isinstance(p, MLAPages)]
    kda = [p for p in host if isinstance(p, KDACache)]
    for i, h in enumerate(hashes[2:7], 2):  # as stored, every layer
        np.testing.assert_array_equal(tier.entries[h].page, np.stack([pages[i + 1] for pages in mla]))
    np.testing.assert_array_equal(tier.entries[hashes[6]].snapshot[1], np.stack([p.state[2] for p in kda]))
    tier.stage(hashes[7], 8, None)  # one more page: the oldest left goes
    pools = tier.transfer(pools, jax.sharding.make_single_device_sharding(jax.local_devices()[0]))
    assert list(tier.entries) == hashes[3:8] and tier.nbytes == 5 * expected_page + expected_slot


def test_fp8_pages_restore_as_stored(model):  # noqa: F811
    """fp8 pages go to the host and back as stored: the restored request's tokens and logprobs are
    those of the same request whose fp8 prefix stayed on the device."""
    engines = {budget: Engine(model, EngineOptions(**OPTIONS, kv_cache_dtype="fp8", kv_offload_bytes=budget))
               for budget in (0, 1 << 30)}
    prompt = np.random.default_rng(5).integers(0, 512, PROMPT).tolist()
    run(engines[0], prompt)
    on_device, _, _ = run(engines[0], prompt)
    run(engines[1 << 30], prompt)
    other_traffic(engines[1 << 30], np.random.default_rng(6))
    assert next(iter(engines[1 << 30].offload.entries.values())).page.dtype == np.dtype(jax.numpy.float8_e4m3fn)
    restored, computed, pages = run(engines[1 << 30], prompt)
    assert (pages, computed) == ((PROMPT - 1) // PAGE, PROMPT - (PROMPT - 1) // PAGE * PAGE)
    assert restored.token_ids == on_device.token_ids and restored.logprobs == on_device.logprobs
