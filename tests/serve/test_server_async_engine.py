"""The engine thread of the server (`serve.async_engine`) over a scripted engine, without a model:
results reach the event loop, the queue bound gives QueueFull, aborts free capacity, a rejected
prompt rejects its whole group, and a failing step fails only the requests in flight."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from serve.async_engine import AsyncEngine, QueueFull
from serve.engine import RequestOutput
from serve.sampling import SamplingParams

BROKEN = [666]  # a prompt whose step raises


class ScriptedEngine:
    """One token per step per request, up to max_tokens (None: forever)."""

    options = SimpleNamespace(max_num_seqs=2, max_model_len=64)
    tokenizer = None
    prefix_cache = None
    speculator = None
    layout = SimpleNamespace(num_pages=9, num_slots=3)
    allocator = SimpleNamespace(free_pages=8, free_slots=2)

    num_running = num_waiting = 0

    def __init__(self):
        self.requests = {}

    def add_request(self, prompt, params, request_id):
        if not prompt:
            raise ValueError("the prompt is empty")
        self.requests[request_id] = (prompt, params, [])

    def abort(self, request_id):
        self.requests.pop(request_id, None)

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.001)
        outputs = []
        for request_id, (prompt, params, tokens) in list(self.requests.items()):
            if prompt == BROKEN:
                raise RuntimeError("a broken step")
            tokens.append(len(tokens))
            finished = len(tokens) == params.max_tokens
            if finished:
                del self.requests[request_id]
            outputs.append(RequestOutput(request_id, prompt, list(tokens), "length" if finished else None))
        return outputs


def run(test):
    """Runs `test(engine)` on a started AsyncEngine (2 running + 1 queued) and stops it."""
    scripted = ScriptedEngine()
    engine = AsyncEngine(scripted, max_queued_requests=1)
    engine.start()
    try:
        asyncio.run(test(engine))
    finally:
        engine.stop()
    return scripted


async def submit_when_room(engine, requests, timeout_s=10):
    """Aborts free their room once the engine thread has taken them, at most a step later."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await engine.submit(requests)
        except QueueFull:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)


async def finals(group) -> dict[int, RequestOutput]:
    return {index: output async for index, output in group if output.finished}


def test_outputs_of_a_group_reach_the_event_loop():
    async def test(engine):
        group = await engine.submit([([1], SamplingParams(max_tokens=3)), ([2], SamplingParams(max_tokens=1))])
        done = await finals(group)
        assert [done[0].token_ids, done[1].token_ids] == [[0, 1, 2], [0]]
        assert engine.metrics.registry.get_sample_value("k3jax:generation_tokens_total") == 4

    run(test)


def test_a_full_queue_refuses_and_aborts_make_room():
    async def test(engine):
        endless = SamplingParams(max_tokens=None)
        groups = [await engine.submit([([i + 1], endless)]) for i in range(3)]
        with pytest.raises(QueueFull):
            await engine.submit([([9], endless)])
        for group in groups:
            group.abort()
        group = await submit_when_room(engine, [([9], SamplingParams(max_tokens=2))])
        assert (await finals(group))[0].token_ids == [0, 1]

    assert run(test).requests == {}


def test_a_rejected_prompt_rejects_its_group():
    async def test(engine):
        with pytest.raises(ValueError, match="empty"):
            await engine.submit([([1], SamplingParams(max_tokens=None)), ([], SamplingParams())])
        # nothing of the group is left running or counted against the queue
        groups = [await engine.submit([([i + 1], SamplingParams(max_tokens=2))]) for i in range(3)]
        assert [len((await finals(g))[0].token_ids) for g in groups] == [2, 2, 2]

    assert run(test).requests == {}


def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_serves_on():
    async def test(engine):
        broken = await engine.submit([(BROKEN, SamplingParams(max_tokens=4))])
        with pytest.raises(RuntimeError, match="a broken step"):
            await finals(broken)
        group = await engine.submit([([1], SamplingParams(max_tokens=2))])
        assert (await finals(group))[0].token_ids == [0, 1] and engine.is_alive()

    run(test)
