"""Anthropic's Messages API (serve/api_anthropic.py) end to end through the official `anthropic`
client, on one k3-tiny server for the module (python -m k3jax.serve); tool use and
thinking through the test hook that forces the model's output."""

import anthropic
import pytest

from serve.api_anthropic import CountTokensRequest
from tests.serve.test_server import API_KEY, MODEL, TOOL_CALL_OUTPUT, start_server, wait_idle

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"name": "get_weather", "description": "Weather by city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
INSTANT_OUTPUT = "Hi there!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(tmp_path_factory, "--max-model-len", "1024", "--max-num-seqs", "2",
                            "--max-num-batched-tokens", "16", "--max-num-partial-prefills", "1", "--enable-test-hooks")


def client(server) -> anthropic.Anthropic:
    # the client sends its key as Anthropic's x-api-key header, which the server accepts beside a bearer token
    return anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key=API_KEY, max_retries=0, timeout=300)


def create(server, **kwargs):
    return client(server).messages.create(**{"model": MODEL, "messages": USER, "max_tokens": 8, **kwargs})


# This client version has no sampling parameters; the API and this server still take them.
GREEDY = {"extra_body": {"temperature": 0}}


def forced(text: str) -> dict:
    return {"extra_body": {"k3jax_test_forced_output": text}}


def events(server, **kwargs) -> list:
    return list(create(server, stream=True, **kwargs))


@pytest.mark.parametrize(("thinking", "effort"), [(None, "none"), ({"type": "disabled"}, "none"),
                                                  ({"type": "enabled", "budget_tokens": 1024}, "low"),
                                                  ({"type": "enabled", "budget_tokens": 4096}, "high"),
                                                  ({"type": "enabled", "budget_tokens": 16384}, "max")])
def test_thinking_budget_maps_to_effort(thinking, effort):
    body = CountTokensRequest.model_validate({"model": MODEL, "messages": USER, "thinking": thinking})
    assert body.chat_fields()[0]["reasoning_effort"] == effort


def test_adaptive_thinking_and_output_effort():
    def effort(**fields):
        body = CountTokensRequest.model_validate({"model": MODEL, "messages": USER, **fields})
        return body.chat_fields()[0].get("reasoning_effort")
    assert effort(thinking={"type": "adaptive"}) is None  # K3's default effort
    assert effort(thinking={"type": "adaptive"}, output_config={"effort": "low"}) == "low"
    assert effort(thinking={"type": "enabled", "budget_tokens": 1024}, output_config={"effort": "max"}) == "max"


def test_text_whole_and_streamed_alike_in_event_order(server):
    wait_idle(server)
    whole = create(server, **GREEDY, system="Be brief.")
    wait_idle(server)
    streamed = events(server, **GREEDY, system="Be brief.")
    kinds = [event.type for event in streamed]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(kinds) - 5) + ["content_block_stop"]
    text = "".join(event.delta.text for event in streamed if event.type == "content_block_delta")
    assert [block.type for block in whole.content] == ["text"] and whole.content[0].text == text
    assert whole.stop_reason == streamed[-2].delta.stop_reason and whole.stop_reason in ("max_tokens", "end_turn")
    assert whole.usage.output_tokens == streamed[-2].usage.output_tokens <= 8
    assert whole.id.startswith("msg_") and whole.role == "assistant" and whole.model == MODEL
    assert streamed[0].message.usage.input_tokens == whole.usage.input_tokens


def test_instant_mode_without_thinking(server):
    message = create(server, **forced(INSTANT_OUTPUT))
    assert [(b.type, b.text) for b in message.content] == [("text", "Hi there!")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None


def test_thinking_and_tool_use_whole_streamed_and_round_trip(server):
    kwargs = {"tools": [WEATHER], "thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 4096,
              **forced(TOOL_CALL_OUTPUT)}
    message = create(server, **kwargs)
    thinking, call = message.content
    assert thinking.type == "thinking" and thinking.thinking == "Need weather."
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris", "days": 3}
    assert call.id.startswith("toolu_") and message.stop_reason == "tool_use"
    with client(server).messages.stream(model=MODEL, messages=USER, **kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "input", None)) for b in final.content] == \
           [("thinking", "Need weather.", None), ("tool_use", None, {"city": "Paris", "days": 3})]
    assert final.stop_reason == "tool_use"
    history = USER + [{"role": "assistant", "content": [block.model_dump() for block in message.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"},
                                                   {"type": "text", "text": "and tomorrow?"}]}]
    answer = create(server, messages=history, tools=[WEATHER], max_tokens=2)
    assert answer.usage.input_tokens > message.usage.input_tokens and answer.stop_reason


def test_count_tokens_is_the_prompts_length(server):
    kwargs = {"system": "Be brief.", "tools": [WEATHER], "messages": USER + [{"role": "assistant", "content": "ok"},
                                                                              {"role": "user", "content": "more"}]}
    counted = client(server).messages.count_tokens(model=MODEL, **kwargs).input_tokens
    assert counted == create(server, max_tokens=1, **kwargs).usage.input_tokens
    assert client(server).messages.count_tokens(model=MODEL, messages=USER).input_tokens < counted


def test_stop_sequence_cuts_whole_and_streamed_alike(server):
    wait_idle(server)
    text = create(server, **GREEDY, max_tokens=12).content[0].text
    stop = text[3:5]
    wait_idle(server)
    whole = create(server, **GREEDY, max_tokens=12, stop_sequences=["zzz", stop])
    wait_idle(server)
    streamed = events(server, **GREEDY, max_tokens=12, stop_sequences=["zzz", stop])
    assert whole.content[0].text == text[:text.find(stop)]
    assert whole.stop_reason == "stop_sequence" and whole.stop_sequence == stop
    assert (streamed[-2].delta.stop_reason, streamed[-2].delta.stop_sequence) == ("stop_sequence", stop)


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
BAD_REQUESTS = [
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0]: the data is not an image"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": USER + [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
     "messages[1].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}]}]},
     "messages[0].content[0].content[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
     "disable_parallel_tool_use"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),  # not below max_tokens
    ({"thinking": {"type": "enabled", "budget_tokens": 100}, "max_tokens": 4096}, "thinking.budget_tokens"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"output_config": {"effort": "medium"}, "thinking": {"type": "adaptive"}}, "output_config.effort"),
    ({"output_config": {"effort": "low"}}, "output_config.effort"),  # instant mode has no effort
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format"),
    ({"thinking": {"type": "adaptive", "display": "omitted"}}, "display"),
    ({"stop_sequences": ["x" * 2000]}, "stop_sequences"),
    ({"extra_body": {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}}, "mcp_servers"),
    ({"messages": [{"role": "user", "content": "x" * 1100}]}, "max_model_len=1024"),
]


@pytest.mark.parametrize(("kwargs", "names"), BAD_REQUESTS, ids=[n for _, n in BAD_REQUESTS])
def test_bad_request_is_400_naming_the_field(server, kwargs, names):
    with pytest.raises(anthropic.BadRequestError) as error:
        create(server, **kwargs)
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "invalid_request_error"
    assert names in error.value.body["error"]["message"]


def test_unknown_fields_ignored_and_unknown_model_is_404(server):
    assert create(server, max_tokens=1, extra_body={"no_such_field": 1}).usage.output_tokens == 1
    with pytest.raises(anthropic.NotFoundError) as error:
        create(server, model="claude-sonnet-4-5")
    assert error.value.body["error"]["type"] == "not_found_error"
