"""Async scheduling (Engine._run_ahead): a steady decode batch's next step is dispatched on the
device-side tokens of the step before, whose host work happens meanwhile. The same requests through
an engine with it and one without must give the same tokens, logprobs, texts and finish reasons:
both run the same batches (a run-ahead row of a request that has stopped is dead: same rows, same
bucket), seeded draws take their key from the token's index, which the step ahead must count
before the token in flight has landed, and every page and slot goes back afterwards."""

import numpy as np
import pytest

import k3jax
from k3jax.serve import engine_options, parse_args
from serve.engine import Engine, EngineOptions
from serve.llm import default_model_dir, load_tokenizer
from serve.sampling import SamplingParams

OPTIONS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=16,
               max_prefill_rows=2, block_size=4, num_gpu_blocks=80, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def engines():
    """(without, with) async scheduling, on the embedded model in fp32 with its tokenizer; the two
    share their compiled steps."""
    path = default_model_dir()
    model = k3jax.from_pretrained(path, dtype="float32")
    tokenizer = load_tokenizer(path)
    return tuple(Engine(model, EngineOptions(**OPTIONS, async_scheduling=on), tokenizer=tokenizer)
                 for on in (False, True))


def run(engine, prompts, params):
    """Every request's one final output, in order, and the steps run ahead meanwhile. A step still
    ahead when the last request finished lands in the next run's first call: nothing may come of it
    there either (every output must belong to this run, and each request finishes once)."""
    before = engine.num_steps_ahead
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    finals = []
    while engine.has_unfinished():
        outputs = engine.step()
        assert {o.request_id for o in outputs} <= set(ids)
        finals += [o for o in outputs if o.finished]
    assert sorted(o.request_id for o in finals) == sorted(ids)
    engine.reset_prefix_cache()
    layout = engine.layout
    assert engine.allocator.free_pages == layout.num_pages - 1 and engine.allocator.free_slots == layout.num_slots - 1
    assert not engine.requests
    by_id = {o.request_id: o for o in finals}
    return ([(by_id[i].token_ids, by_id[i].finish_reason, by_id[i].text, by_id[i].logprobs) for i in ids],
            engine.num_steps_ahead - before)


def test_the_same_outputs_with_and_without_running_ahead(engines):
    sync, ahead = engines
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 200, int(n)).tolist() for n in (5, 23, 9, 14)]
    plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (12, 7, 15, 10)]
    plain[1] = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=7, ignore_eos=True, logprobs=2)
    first, steps_ahead = run(sync, prompts, plain)
    assert steps_ahead == 0
    assert run(ahead, prompts, plain)[0] == first

    # Requests that stop on a token or a text seen part-way (the step ahead then holds a dead row for
    # them while the others go on), a seeded one whose draws must not shift, and one that ends by
    # length, which a step ahead must not run past.
    (tokens0, _, text0, _), (tokens1, *_), (_, _, text2, _) = first[:3]
    stopping = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[tokens0[4]]),
                SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=7, ignore_eos=True, logprobs=2),
                SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True, stop=[text2[len(text2) // 2:][:2]]),
                SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]
    want, _ = run(sync, prompts, stopping)
    got, steps_ahead = run(ahead, prompts, stopping)
    assert got == want
    assert steps_ahead > 0
    assert [reason for _, reason, _, _ in want] == ["stop", "length", "stop", "length"]
    assert want[0][0] == tokens0[:tokens0.index(tokens0[4]) + 1] and want[1][0] == tokens1
    assert len(want[2][0]) < 15


def test_a_request_arriving_mid_run_and_an_abort_lose_nothing(engines):
    """The engine stops running ahead when a request waits (the scheduler admits it on the next call,
    one after the engine without async scheduling: the step already ahead lands first) and an abort
    while a step is ahead leaves only a dead row: the other requests' tokens are those of the engine
    without async scheduling, run the same way."""
    def script(engine):
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        first = engine.add_request([1, 2, 3, 4, 5], params)
        doomed = engine.add_request([9, 8, 7], params)
        done, calls, late_starts = {}, 0, None
        while engine.has_unfinished():
            calls += 1
            if calls == 4:
                engine.add_request([5, 6, 7, 8, 9, 10], params, request_id="late")
            if calls == 6:
                engine.abort(doomed)
            outputs = engine.step()
            if late_starts is None and any(o.request_id == "late" for o in outputs):
                late_starts = calls
            done.update({o.request_id: o.token_ids for o in outputs if o.finished})
        engine.reset_prefix_cache()
        assert engine.allocator.free_pages == engine.layout.num_pages - 1
        return (done[first], done["late"], doomed in done), late_starts

    sync, ahead = engines
    before = ahead.num_steps_ahead
    (want, sync_start), (got, ahead_start) = script(sync), script(ahead)
    assert got == want and not want[2]
    assert ahead_start == sync_start + 1
    assert ahead.num_steps_ahead > before


def test_the_command_line_turns_it_off():
    assert engine_options(parse_args([])).async_scheduling
    assert not engine_options(parse_args(["--no-async-scheduling"])).async_scheduling
