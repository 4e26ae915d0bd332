"""Agent-session retention (serve/sessions.py): a conversation sent with a `prompt_cache_key` keeps its
prefix pinned in the prefix cache between turns, against traffic that evicts everything else.

Each turn resends the whole conversation (the previous prompt, the previous output, a new message).
Between turns, other requests touch more new pages than the pool holds, so an unpinned conversation
is evicted. With its key, each turn must compute only what the previous turn did not (the part of
its last page past the last page boundary, the previous turn's last token, the new message), counted
by the engine's prompt-token counter, and its tokens must be the reference's (tests/agreement.py:
the full forward of the turn's own tokens, which knows nothing of caches). Without the key the same
conversation computes every prompt token again. Pins then expire after their TTL, the byte budget
releases the oldest, pins give way to a request that could not run otherwise, and a bad key is a 400
naming `prompt_cache_key`.
"""

import numpy as np
import pytest
from fastapi.testclient import TestClient

from k3jax.serve import engine_options, parse_args
from serve.api_common import ServerConfig
from serve.api_server import build_app
from serve.async_engine import AsyncEngine
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams
from serve.sessions import MAX_KEY_CHARS, SessionParams
from tests.serve.test_engine import assert_pool_full, model, referee  # noqa: F401

PAGE = 4
PAGES = 48  # with the null page: 47 usable, fewer than the other traffic between two turns touches
OPTIONS = dict(max_model_len=96, max_num_seqs=2, max_num_batched_tokens=24, max_prefill_chunk=16,
               max_prefill_rows=2, block_size=PAGE, num_gpu_blocks=PAGES, enable_prefix_caching=True)
TURNS, FIRST, NEW, OUT = 5, 20, 6, 6  # the conversation: 20 tokens, then 6 out and 6 new per turn


@pytest.fixture(scope="module")
def engine(model):  # noqa: F811
    return Engine(model, EngineOptions(**OPTIONS, session_ttl=1000.0))


def greedy(max_tokens, key=None):
    return SessionParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_cache_key=key)


def other_traffic(engine, rng):
    """Four 50-token prompts of their own (14 pages each, two at a time): 56 new pages, more than the
    pool, so everything unpinned that was cached before is evicted."""
    prompts = [rng.integers(0, 512, 50).tolist() for _ in range(4)]
    engine.generate(prompts, [greedy(4)] * len(prompts))


def converse(engine, referee, key, seed):  # noqa: F811
    """Runs the conversation with other traffic between its turns; per turn (prompt length, prompt
    tokens found cached, prompt tokens the engine computed, pages pinned after it)."""
    rng = np.random.default_rng(seed)
    conversation = rng.integers(0, 512, FIRST).tolist()
    turns, prompts, outputs = [], [], []
    for _ in range(TURNS):
        computed = engine.stats()["num_computed_prompt_tokens"]
        out = engine.generate([conversation], [greedy(OUT, key)])[0]
        stats = engine.stats()
        turns.append((len(conversation), out.num_cached_tokens, stats["num_computed_prompt_tokens"] - computed,
                      stats["session_pinned_pages"]))
        prompts.append(conversation)
        outputs.append(out)
        other_traffic(engine, rng)
        conversation = conversation + out.token_ids + rng.integers(0, 512, NEW).tolist()
    referee.check_all(prompts, [o.token_ids for o in outputs], what="turn")  # each turn as a cold run computes it
    return turns


def test_a_session_prefills_only_its_new_tokens_under_eviction_pressure(engine, referee):  # noqa: F811
    turns = converse(engine, referee, "agent-1", seed=1)
    previous = None
    for length, cached, computed, pinned in turns:
        assert computed == length - cached
        # what the previous turn computed (all its tokens but the last output), up to its last page boundary
        expected = 0 if previous is None else (previous - 1) // PAGE * PAGE
        assert cached == expected, turns
        # after the first: the new message, the previous turn's last token, and at most a page's worth
        assert previous is None or computed <= NEW + PAGE, turns
        assert pinned == (length + OUT - 1) // PAGE  # one pin, the turn's chain: it replaced the previous
        previous = length + OUT
    assert engine.stats()["session_pins"] == 1
    assert_pool_full(engine)  # releases the pin: every page and slot comes back


def test_without_a_session_key_every_turn_prefills_everything(engine, referee):  # noqa: F811
    turns = converse(engine, referee, None, seed=2)
    assert [(cached, computed) for length, cached, computed, _ in turns] == [(0, length) for length, *_ in turns]
    assert_pool_full(engine)


def pin_one(engine, key, length, seed):
    """A request of session `key` with a `length`-token prompt, run to its end: its prompt and output."""
    prompt = np.random.default_rng(seed).integers(0, 512, length).tolist()
    return prompt, engine.generate([prompt], [greedy(OUT, key)])[0]


def test_an_expired_pin_becomes_an_ordinary_cache_entry(model):  # noqa: F811
    engine = Engine(model, EngineOptions(**OPTIONS, session_ttl=60.0))
    now = [0.0]
    engine.sessions.clock = lambda: now[0]
    prompt, out = pin_one(engine, "a", 30, seed=3)
    pinned = (len(prompt) + OUT - 1) // PAGE
    usable = PAGES - 1
    now[0] = 59.0
    engine.step()  # nothing to run: the scheduler only looks at the pins' deadlines
    engine.allocator.reset_prefix_cache()  # evicts what nobody holds: not the pinned pages
    assert engine.stats()["session_pinned_pages"] == pinned and engine.allocator.free_pages == usable - pinned
    now[0] = 60.0
    engine.step()
    assert engine.stats()["session_pins"] == 0
    # unpinned but still cached: the same conversation hits it, then the LRU may evict all of it
    again = engine.generate([prompt + out.token_ids], [greedy(OUT)])[0]
    assert again.num_cached_tokens == pinned * PAGE
    engine.allocator.reset_prefix_cache()
    assert engine.allocator.free_pages == usable


def test_the_byte_budget_releases_the_oldest_pins(model, engine):  # noqa: F811
    page_bytes, slot_bytes = engine.sessions.page_bytes, engine.sessions.slot_bytes
    # room for the snapshot's slot and 16 pages: one of these sessions (9 and 8 pages pinned), not both
    engine = Engine(model, EngineOptions(**OPTIONS, session_cache_bytes=slot_bytes + 16 * page_bytes))
    pin_one(engine, "a", 34, seed=4)
    assert engine.stats()["session_pins"] == 1 and engine.stats()["session_pinned_pages"] == 9
    pin_one(engine, "b", 30, seed=5)  # 8 pages: a's 9 and b's 8 exceed 16, so a (the oldest) goes
    stats = engine.stats()
    assert list(engine.sessions.pins) == ["b"] and stats["session_pinned_pages"] == 8
    assert stats["session_pinned_bytes"] == slot_bytes + 8 * page_bytes
    engine.abort(engine.add_request([1, 2, 3], greedy(2, "b")))  # a turn aborted before it ran: b's pin stays
    assert list(engine.sessions.pins) == ["b"] and engine.stats()["session_pinned_pages"] == 8
    engine.allocator.reset_prefix_cache()
    assert engine.allocator.free_pages == PAGES - 1 - 8
    # a budget that cannot hold one pin turns sessions off: the key is refused, not silently ignored
    off = Engine(model, EngineOptions(**OPTIONS, session_cache_bytes=0))
    with pytest.raises(ValueError, match="^prompt_cache_key: "):
        off.add_request([1, 2, 3], greedy(2, "a"))


def test_pins_give_way_to_a_request_that_could_not_run_otherwise(model, referee):  # noqa: F811
    engine = Engine(model, EngineOptions(**{**OPTIONS, "max_model_len": 160, "num_gpu_blocks": 44},
                                         session_cache_bytes=1 << 30))
    for i, key in enumerate("ab"):  # as many pins as snapshot slots (max_num_seqs by default)
        pin_one(engine, key, 40, seed=10 + i)  # 11 pages each: 22 of the 43
    assert engine.stats()["session_pinned_pages"] == 22
    prompt = np.random.default_rng(13).integers(0, 512, 100).tolist()  # 28 pages with its output
    out = engine.generate([prompt], [greedy(12)])[0]
    referee.check_all([prompt], [out.token_ids])
    assert list(engine.sessions.pins) == ["b"]  # the oldest gave way; the younger fits beside the request
    assert_pool_full(engine)


def test_prompt_cache_key_through_the_http_api(model):  # noqa: F811
    """A key that is not a string, empty or too long is a 400 naming the field on every route; a
    server that cannot keep sessions (no prefix caching) refuses the key; one that can pins the
    conversation of a completion sent with it."""
    def post(client, route, **fields):
        if route == "responses":
            return client.post("/v1/responses", json={"model": "m", "max_output_tokens": 3, "temperature": 0,
                                                      "input": "hi", **fields})
        body = {"model": "m", "max_tokens": 3, "temperature": 0, **fields}
        body.update({"prompt": [5, 6, 7] * 7} if route == "completions" else {"messages": [{"role": "user",
                                                                                        "content": "hi"}]})
        return client.post(f"/v1/{route}", json=body)

    config = ServerConfig(model_name="m", model_path="/m")
    engine = Engine(model, EngineOptions(**OPTIONS))
    with TestClient(build_app(AsyncEngine(engine, max_queued_requests=4), config)) as client:
        for route in ("completions", "chat/completions", "responses"):
            for key in (7, ["a"], "", "k" * (MAX_KEY_CHARS + 1)):
                response = post(client, route, prompt_cache_key=key)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == "prompt_cache_key", response.json()
        ok = post(client, "completions", prompt_cache_key="k" * MAX_KEY_CHARS)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a cold prompt
        again = post(client, "completions").json()["usage"]  # the same prompt: its whole pages are cached
        cached = again["prompt_tokens_details"]["cached_tokens"]
        assert cached == (again["prompt_tokens"] - 1) // PAGE * PAGE > 0
    assert list(engine.sessions.pins) == ["k" * MAX_KEY_CHARS]
    plain = Engine(model, EngineOptions(**{**OPTIONS, "enable_prefix_caching": False}))
    with TestClient(build_app(AsyncEngine(plain, max_queued_requests=4), config)) as client:
        response = post(client, "completions", prompt_cache_key="a")
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_cache_key"
        assert post(client, "completions").status_code == 200


def test_session_params_refuse_a_bad_key_and_keep_sampling_params_fields():
    for key in (7, "", "k" * (MAX_KEY_CHARS + 1)):
        with pytest.raises(ValueError, match="^prompt_cache_key: "):
            SessionParams(prompt_cache_key=key)
    params = SessionParams(temperature=0.5, max_tokens=3, prompt_cache_key="a")
    assert isinstance(params, SamplingParams) and params.temperature == 0.5 and params.max_tokens == 3


def test_command_line_options_reach_the_engine():
    options = engine_options(parse_args(["--enable-prefix-caching", "--session-ttl", "30",
                                         "--session-cache-bytes", "4096"]))
    assert (options.session_ttl, options.session_cache_bytes) == (30.0, 4096)
    assert engine_options(parse_args([])).session_cache_bytes is None  # a quarter of the cache
    for bad in (["--session-ttl", "-1"], ["--session-cache-bytes", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
