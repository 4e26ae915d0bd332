"""OpenAI's Responses API (serve/api_responses.py) end to end through the official `openai` client,
on one k3-tiny server for the module (python -m k3jax.serve); reasoning and function
calls through the test hook that forces the model's output."""

import asyncio
import itertools
import json
import time

import numpy as np
import openai
import pytest

import k3jax
from serve.api_chat_bridge import ContentTokens
from serve.api_common import APIError
from serve.api_responses_store import ResponseStore
from serve.chat import parse_output
from serve.llm import default_model_dir, load_tokenizer
from tests.agreement import FP32, Referee
from tests.serve.test_server import API_KEY, LONG, MODEL, TOOL_CALL_OUTPUT, post, start_server, wait_idle

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather by city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
INSTANT = {"effort": "none"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(tmp_path_factory, "--max-model-len", "1024", "--max-num-seqs", "2",
                            "--max-num-batched-tokens", "16", "--max-num-partial-prefills", "1", "--enable-test-hooks")


def create(server, **kwargs):
    return server.client().responses.create(**{"model": MODEL, "input": "hi", "max_output_tokens": 8, **kwargs})


def forced(text: str, **extra_body) -> dict:
    return {"extra_body": {"k3jax_test_forced_output": text, **extra_body}}


def test_text_whole_and_streamed_alike_in_event_order(server):
    kwargs = {"temperature": 0, "reasoning": INSTANT, "extra_body": LONG}
    wait_idle(server)
    whole = create(server, **kwargs)
    wait_idle(server)
    events = list(create(server, stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert whole.output_text == final.output_text == text == events[-4].text
    assert whole.status == final.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == final.usage.output_tokens == 8
    assert whole.id.startswith("resp_") and final.output[0].id == events[2].item.id


def test_reasoning_and_function_call_whole_streamed_and_round_trip(server):
    kwargs = {"tools": [WEATHER], "max_output_tokens": None, **forced(TOOL_CALL_OUTPUT)}
    response = create(server, **kwargs)
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Need weather."
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3} and response.status == "completed"
    events = list(create(server, stream=True, **kwargs))
    kinds = [kind for kind, _ in itertools.groupby(event.type for event in events)]  # deltas counted once
    assert kinds[2:8] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.done",
                          "response.content_part.done", "response.output_item.done"]
    assert kinds[8:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[1].arguments == call.arguments
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [call.arguments]
    # the call's output, sent back by previous_response_id or with the whole conversation, makes one prompt
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    chained = create(server, previous_response_id=response.id, input=[result], tools=[WEATHER], max_output_tokens=1)
    history = [{"role": "user", "content": "hi"}, *[item.model_dump(exclude_none=True) for item in response.output],
               result]
    resent = create(server, input=history, tools=[WEATHER], max_output_tokens=1)
    assert chained.usage.input_tokens == resent.usage.input_tokens > response.usage.input_tokens
    assert chained.previous_response_id == response.id


def test_instructions_and_instant_mode(server):
    text = "Hi there!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    response = create(server, instructions="Be brief.", reasoning=INSTANT, **forced(text))
    assert [item.type for item in response.output] == ["message"] and response.output_text == "Hi there!"
    assert response.instructions == "Be brief." and response.status == "completed"
    plain = create(server, reasoning=INSTANT, **forced(text))
    assert plain.usage.input_tokens < response.usage.input_tokens


def test_previous_response_id_chains_and_store(server):
    first = create(server, instructions="Be brief.", reasoning=INSTANT, **forced("Hello!"))
    second = create(server, previous_response_id=first.id, input="again", reasoning=INSTANT, **forced("Bye."))
    third = create(server, previous_response_id=second.id, input="and?", reasoning=INSTANT, max_output_tokens=1)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
               {"role": "user", "content": "again"}, {"role": "assistant", "content": "Bye."},
               {"role": "user", "content": "and?"}]
    # the first response's instructions are not carried over
    assert third.usage.input_tokens == create(server, input=history, reasoning=INSTANT,
                                              max_output_tokens=1).usage.input_tokens
    assert server.client().responses.retrieve(second.id).output_text == "Bye."
    unstored = create(server, store=False, max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as error:
        create(server, previous_response_id=unstored.id)
    assert error.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        server.client().responses.retrieve(unstored.id)


BAD_REQUESTS = [
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"},
                                             {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     "input[0].content[1]: the data is not an image"),  # refused without a tower: tests/serve/test_engine_images.py
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"}]},
     "input[0].encrypted_content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"reasoning": {"effort": "medium"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"background": True, "store": False}, "background: can only be used when `store` is true"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"top_logprobs": 2}, "top_logprobs: needs include"),
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"previous_response_id": "resp_nothing"}, "previous_response_id"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x" * 1100}, "max_model_len=1024"),
]


@pytest.mark.parametrize(("kwargs", "names"), BAD_REQUESTS, ids=[n for _, n in BAD_REQUESTS])
def test_bad_request_is_400_naming_the_field(server, kwargs, names):
    with pytest.raises(openai.BadRequestError) as error:
        create(server, **kwargs)
    assert names in error.value.body["message"] and error.value.body["type"] == "invalid_request_error"


def test_unknown_fields_ignored(server):
    assert create(server, max_output_tokens=1, extra_body={"no_such_field": 1, **LONG}).usage.output_tokens == 1


def test_output_text_logprobs_whole_and_streamed_match_the_reference(server):
    """Instant mode with every special token banned: all output tokens are the content's. Their
    logprobs (a whole response's, and the stream's deltas joined) are the reference forward's over
    the prompt and those tokens; the stream, run alone as the whole one, gives the same figures."""
    tokenizer = load_tokenizer(default_model_dir())
    text_only = {**LONG, "logit_bias": {str(i): -100 for i in tokenizer.special_ids}}
    kwargs = {"temperature": 0, "reasoning": INSTANT, "include": ["message.output_text.logprobs"],
              "top_logprobs": 2, "extra_body": text_only}
    wait_idle(server)
    whole = create(server, **kwargs)
    wait_idle(server)
    events = list(create(server, stream=True, **kwargs))
    logprobs = whole.output[0].content[0].logprobs
    assert len(logprobs) == whole.usage.output_tokens == 8 and "".join(lp.token for lp in logprobs) == whole.output_text
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done").logprobs
    final = events[-1].response.output[0].content[0].logprobs
    assert [lp.model_dump() for lp in streamed] == [lp.model_dump() for lp in logprobs]
    assert [lp.model_dump() for lp in done] == [lp.model_dump() for lp in final] == \
        [lp.model_dump() for lp in logprobs]
    assert events[-1].response.top_logprobs == 2
    # the reference: the chat prompt of the same conversation, then the output tokens, teacher-forced
    _, body = post(server, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                         "reasoning_effort": "none"})
    prompt = json.loads(body)["tokens"]
    assert len(prompt) == whole.usage.input_tokens
    by_bytes = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size) if i not in tokenizer.special_ids}
    output = [by_bytes[bytes(lp.bytes)] for lp in logprobs]
    logits = Referee(k3jax.from_pretrained(default_model_dir(), dtype="float32"), pad=512).run(prompt + output).logits
    want = logits - np.logaddexp.reduce(logits.astype(np.float64), axis=-1, keepdims=True)
    tol = 2 * FP32.logits * np.abs(want).max()
    for t, lp in enumerate(logprobs):
        row = want[len(prompt) - 1 + t]
        assert abs(lp.logprob - row[output[t]]) <= tol
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
        assert [top.logprob for top in lp.top_logprobs] == pytest.approx(np.sort(row)[::-1][:2], abs=tol)


def test_without_include_no_logprobs(server):
    response = create(server, reasoning=INSTANT, max_output_tokens=2, extra_body=LONG)
    assert response.output[-1].content[0].logprobs == [] and response.top_logprobs is None


def test_delete_forgets_and_cancel_answers_as_vllm_for_a_synchronous_response(server):
    client = server.client()
    response = create(server, max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.cancel(response.id)
    assert error.value.body["message"] == "Cannot cancel a synchronous response." and \
        error.value.body["param"] == "response_id"
    assert client.responses.retrieve(response.id).id == response.id  # cancel changed nothing
    status, body = server.request("DELETE", f"/v1/responses/{response.id}",
                                  headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and json.loads(body) == {"id": response.id, "object": "response", "deleted": True}
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call(response.id)
    with pytest.raises(openai.BadRequestError) as error:
        create(server, previous_response_id=response.id)
    assert error.value.body["param"] == "previous_response_id"
    client.responses.delete(create(server, max_output_tokens=1).id)  # the official client's call


@pytest.mark.parametrize(("text", "thinking"), [
    ("Plan.<|close|>think<|sep|><|open|>response<|sep|>Hello there.<|close|>response<|sep|><|close|>message<|sep|>", True),
    ("Hello there.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", False),
    (TOOL_CALL_OUTPUT, True)], ids=["thinking", "instant", "tool_call"])
def test_content_tokens_decode_to_the_parsers_content(text, thinking):
    """The tokens whose logprobs output_text carries are those of the content the K3 parser reads,
    fed in deltas of any split."""
    tokenizer = load_tokenizer(default_model_dir())
    ids = tokenizer.encode(text, allow_special=True)
    want = parse_output(text, thinking=thinking, tools=[WEATHER]).content or ""
    for split in range(len(ids)):
        content = ContentTokens(tokenizer, thinking)
        positions = content.positions(ids[:split]) + [split + p for p in content.positions(ids[split:])]
        assert tokenizer.decode([ids[p] for p in positions]) == want


def poll(server, response_id: str, statuses=("queued", "in_progress")):
    """GET the response until its status leaves `statuses`; every status seen on the way."""
    seen = []
    while True:
        response = server.client().responses.retrieve(response_id)
        seen.append(response.status)
        if response.status not in statuses:
            return response, seen
        time.sleep(0.05)


def test_background_response_polled_to_completion_is_the_synchronous_one(server):
    kwargs = {"temperature": 0, "reasoning": INSTANT, "extra_body": LONG}
    wait_idle(server)
    whole = create(server, **kwargs)
    wait_idle(server)
    queued = create(server, background=True, **kwargs)
    assert queued.status in ("queued", "in_progress") and queued.background and queued.output == []
    final, seen = poll(server, queued.id)
    assert set(seen[:-1]) <= {"queued", "in_progress"} and final.status == whole.status == "incomplete"
    assert final.id == queued.id and final.output_text == whole.output_text
    assert final.usage.model_dump() == whole.usage.model_dump()
    with pytest.raises(openai.BadRequestError) as error:  # finished: vLLM's answer for a finished response
        server.client().responses.cancel(final.id)
    assert error.value.body["message"] == "Cannot cancel a synchronous response."
    chained = create(server, previous_response_id=final.id, input="more", max_output_tokens=1)  # stored as any
    history = [{"role": "user", "content": "hi"}, *[item.model_dump(exclude_none=True) for item in final.output],
               {"role": "user", "content": "more"}]
    assert chained.usage.input_tokens == create(server, input=history, max_output_tokens=1).usage.input_tokens


def test_background_stream_is_the_stream_and_get_replays_it(server):
    kwargs = {"temperature": 0, "reasoning": INSTANT, "extra_body": LONG}
    wait_idle(server)
    live = list(create(server, stream=True, **kwargs))
    wait_idle(server)
    events = list(create(server, stream=True, background=True, **kwargs))
    assert [e.type for e in events] == [e.type for e in live]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == live[-1].response.output_text
    response_id = events[0].response.id
    replayed = list(server.client().responses.retrieve(response_id, stream=True, starting_after=3))
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in events[4:]]
    assert server.client().responses.retrieve(response_id).output_text == live[-1].response.output_text
    with pytest.raises(openai.BadRequestError) as error:  # only a background stream's events are kept
        list(server.client().responses.retrieve(create(server, max_output_tokens=1).id, stream=True))
    assert error.value.body["param"] == "stream"


def test_cancelled_background_response_frees_the_engine_and_others_go_on(server):
    """A background response as long as the context allows, cancelled while it runs: it ends
    "cancelled", its engine request is aborted (every page and slot back), and the server serves a
    request that ran beside it and the ones after."""
    client = server.client()
    wait_idle(server, pool_full=True)
    running = create(server, background=True, max_output_tokens=None, extra_body=LONG)
    beside = create(server, max_output_tokens=4, extra_body=LONG)
    assert beside.status == "incomplete" and beside.usage.output_tokens == 4
    cancelled = client.responses.cancel(running.id)
    assert cancelled.id == running.id and cancelled.status == "cancelled"
    wait_idle(server, pool_full=True)
    assert client.responses.retrieve(running.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.cancel(running.id)
    assert error.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as error:  # no output to continue from
        create(server, previous_response_id=running.id)
    assert error.value.body["message"].startswith(f"previous_response_id: response {running.id!r} is cancelled")
    # forgetting a response that runs cancels it too
    deleted = create(server, background=True, max_output_tokens=None, extra_body=LONG)
    with pytest.raises(openai.BadRequestError) as error:
        create(server, previous_response_id=deleted.id)
    assert "only a finished response can be continued" in error.value.body["message"]
    client.responses.delete(deleted.id)
    wait_idle(server, pool_full=True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(deleted.id)
    assert create(server, max_output_tokens=2, extra_body=LONG).usage.output_tokens == 2


def test_the_store_stops_the_runs_it_forgets_or_cancels_before_they_start():
    """Past max_stored the oldest response goes: one still running has its task cancelled and its
    engine request aborted. A streamed run cancelled before its task ever ran ends its readers."""
    async def scenario():
        store, aborted, cancelled = ResponseStore(max_stored=1), [], []

        async def runs():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append("a")
                raise

        store.run_in_background("a", {"id": "a", "status": "queued"}, runs(), lambda: aborted.append("a"))
        await asyncio.sleep(0)  # its task starts
        store.put("b", [], {"id": "b", "status": "completed"})
        await asyncio.sleep(0)
        assert cancelled == ["a"] and "a" in aborted
        with pytest.raises(APIError):
            store.get("a")

        async def events():
            yield "never sent"

        store.run_in_background("c", {"id": "c", "status": "queued"}, events(), lambda: aborted.append("c"))
        replay = store.events("c", None)
        assert (await store.cancel("c"))["status"] == "cancelled" and "c" in aborted
        assert [event async for event in replay] == []

    asyncio.run(scenario())
