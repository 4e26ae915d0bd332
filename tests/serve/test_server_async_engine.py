"""The engine thread of the server (`serve.async_engine`) over a scripted engine, without a model:
results reach the event loop as deltas, the queue bound gives QueueFull, aborts free capacity, a
rejected prompt rejects its whole group, a failing step fails only the requests in flight, a request
the engine failed alone fails only its group, and a reader that falls behind pauses only its own
requests (aborted after the stall timeout), its backlog bounded."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from serve.async_engine import AsyncEngine, QueueFull, RequestFailed
from serve.engine import RequestOutput
from serve.sampling import SamplingParams

BROKEN = [666]  # a prompt whose step raises
FAILING = [667]  # a prompt the engine fails alone (finish_reason "error")
SECRET = [668]  # a prompt whose admission raises an unexpected error


class ScriptedEngine:
    """One token per step per request, up to max_tokens (None: forever)."""

    options = SimpleNamespace(max_num_seqs=2, max_model_len=64)
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=1000))
    tokenizer = None
    prefix_cache = None
    speculator = None
    layout = SimpleNamespace(num_pages=9, num_slots=3)
    allocator = SimpleNamespace(free_pages=8, free_slots=2)

    num_running = num_waiting = 0

    def __init__(self):
        self.requests = {}
        self.paused = set()
        self.idle = False
        self.steps = 0

    def add_request(self, prompt, params, request_id):
        if prompt == SECRET:
            raise RuntimeError("secret internal detail")
        if not prompt:
            raise ValueError("the prompt is empty")
        self.requests[request_id] = (prompt, params, [])

    def abort(self, request_id):
        self.requests.pop(request_id, None)

    def pause(self, request_id, paused=True):
        (self.paused.add if paused else self.paused.discard)(request_id)

    def has_unfinished(self):
        return bool(self.requests)

    def step(self, deltas=False):
        time.sleep(0.001)
        self.steps += 1
        running = [(i, r) for i, r in self.requests.items() if i not in self.paused]
        self.idle = not running
        outputs = []
        for request_id, (prompt, params, tokens) in running:
            if prompt == BROKEN:
                raise RuntimeError("a broken step")
            tokens.append(len(tokens))
            finished = len(tokens) == params.max_tokens
            reason = "error" if prompt == FAILING else "length" if finished else None
            if reason is not None:
                del self.requests[request_id]
            outputs.append(RequestOutput(request_id, prompt, tokens[-1:] if deltas else list(tokens), reason))
        return outputs


def run(test, **options):
    """Runs `test(engine)` on a started AsyncEngine (2 running + 1 queued) and stops it."""
    scripted = ScriptedEngine()
    engine = AsyncEngine(scripted, max_queued_requests=1, **options)
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
    """Each request's output, its deltas joined."""
    joined = {}
    async for index, delta in group:
        if index in joined:
            joined[index].token_ids += delta.token_ids
            joined[index].finish_reason = delta.finish_reason
        else:
            joined[index] = delta
    return joined


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
        with pytest.raises(RequestFailed, match="engine failed"):
            await finals(broken)
        group = await engine.submit([([1], SamplingParams(max_tokens=2))])
        assert (await finals(group))[0].token_ids == [0, 1] and engine.is_alive()

    run(test)


def test_a_request_the_engine_failed_fails_its_group_alone():
    async def test(engine):
        other = await engine.submit([([1], SamplingParams(max_tokens=6))])
        failing = await engine.submit([(FAILING, SamplingParams(max_tokens=6)), ([2], SamplingParams(max_tokens=None))])
        with pytest.raises(RequestFailed, match="failed while generating"):
            await finals(failing)
        assert (await finals(other))[0].token_ids == list(range(6))

    assert run(test).requests == {}  # the failing group's other request was aborted


def test_a_reader_that_stops_reading_pauses_its_request_and_is_aborted_after_the_timeout():
    async def test(engine):
        stalled = await engine.submit([([1], SamplingParams(max_tokens=None))])
        reading = await engine.submit([([2], SamplingParams(max_tokens=200))])
        assert len((await finals(reading))[0].token_ids) == 200  # while the other reader sleeps
        deadline = time.monotonic() + 10
        while "0-0" in engine.engine.requests:
            assert time.monotonic() < deadline, "the stalled request was never aborted"
            assert stalled.backlog <= 4 + 1  # paused once over the bound: at most one more step's output
            await asyncio.sleep(0.01)
        with pytest.raises(RequestFailed, match="did not read"):
            await finals(stalled)
        assert engine.metrics.registry.get_sample_value("k3jax:request_success_total",
                                                        {"finished_reason": "abort"}) == 1

    run(test, max_backlog=4, stall_timeout_s=0.5)


def test_a_reader_that_catches_up_resumes_its_request_and_nothing_spins_meanwhile():
    async def test(engine):
        group = await engine.submit([([1], SamplingParams(max_tokens=50))])
        deadline = time.monotonic() + 10
        while group.backlog < 5:  # the request pauses once 5 outputs are unread
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        steps = engine.engine.steps
        await asyncio.sleep(0.2)  # the engine thread sleeps meanwhile: at most the step already under way
        assert engine.engine.steps - steps <= 1 and group.backlog == 5
        assert (await finals(group))[0].token_ids == list(range(50))  # reading resumes it, to the end

    run(test, max_backlog=4, stall_timeout_s=5)


def test_no_response_carries_exception_text():
    """500s and stream error events say what failed in the API's words; the exception's own text
    (internal names, paths, values) goes to the server log only."""
    from fastapi.testclient import TestClient

    from serve.api_server import ServerConfig, build_app

    engine = AsyncEngine(ScriptedEngine(), max_queued_requests=1)
    app = build_app(engine, ServerConfig(model_name="m", model_path="/m"))
    with TestClient(app, raise_server_exceptions=False) as client:  # the server logs them; a client sees a 500
        for prompt in (BROKEN, SECRET):
            response = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 3})
            error = response.json()["error"]
            assert response.status_code == 500 and error["type"] == "server_error", error
            assert "broken" not in error["message"] and "secret" not in error["message"]
        streamed = client.post("/v1/completions", json={"model": "m", "prompt": BROKEN, "max_tokens": 3,
                                                        "stream": True})
        assert '"server_error"' in streamed.text and "broken" not in streamed.text
        assert streamed.text.endswith("data: [DONE]\n\n")
