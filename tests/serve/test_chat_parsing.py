"""Output parsing against the worked examples of the serving spec (section 5.3, E1-E9) and facts
section F (#1-#9), the failure modes of spec 5.4, and stream == non-stream for every way of
splitting each example."""

import json
import random
import re

import pytest

from convert import synth
from k3jax.config import K3Config
from k3jax.presets import PRESETS
from serve.chat import OutputParser, Tokenizer, parse_output

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def call(name, arguments):
    return {"name": name, "arguments": arguments}


def xtml_call(name_attr, *arguments, closed=True):
    """A call element; `arguments` are (key, type, value) triples."""
    body = "".join(f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>' for k, t, v in arguments)
    return f"<|open|>call {name_attr} index=\"1\"<|sep|>{body}" + ("<|close|>call<|sep|>" if closed else "")


THINK_END = "<|close|>think<|sep|><|open|>response<|sep|>"
END = "<|close|>message<|sep|>"

# (name, generated text, thinking, tools, reasoning_content, content, tool_calls)
EXAMPLES = [
    ("E1", "The user wants 2+2.<|close|>think<|sep|><|open|>response<|sep|>4<|close|>response<|sep|>" + END,
     True, None, "The user wants 2+2.", "4", []),
    ("E2", "Hello! How can I help?<|close|>response<|sep|>" + END,
     False, None, None, "Hello! How can I help?", []),
    ("E3", 'Need the weather.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
     '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
     '<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
     '<|close|>call<|sep|><|close|>tools<|sep|>' + END,
     True, TOOLS, "Need the weather.", None, [call("get_weather", '{"city": "Paris", "days": 3}')]),
    ("E4", '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="search" index="1"<|sep|>'
     '<|open|>argument key="q" type="string"<|sep|>say "hi" & bye<|close|>argument<|sep|>'
     '<|open|>argument key="opts" type="object"<|sep|>{"limit": 5, "safe": true}<|close|>argument<|sep|>'
     '<|close|>call<|sep|><|open|>call tool="a&amp;b" index="2"<|sep|><|open|>argument key="flag" type="boolean"'
     '<|sep|>false<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>' + END,
     False, TOOLS, None, None,
     [call("search", '{"q": "say \\"hi\\" & bye", "opts": {"limit": 5, "safe": true}}'), call("a&b", '{"flag": false}')]),
    ("E5", ('Let me check.<|close|>think<|sep|><|open|>response<|sep|>Checking…<|close|>response<|sep|>'
            '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument key="x" type="string"<|sep|>abc'),
     True, TOOLS, "Let me check.", "Checking…", []),
    ("E6", "Count.<|close|>think<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
     + xtml_call('tool="f"', ("n", "number", "3,")) + "<|close|>tools<|sep|>" + END,
     True, TOOLS, "Count.", None, [call("f", '{"n": "3,"}')]),
    ("E7", "No name.<|close|>think<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
     + xtml_call('name="f"', ("x", "string", "1")) + "<|close|>tools<|sep|>" + END,
     True, TOOLS, "No name.", None, []),
    ("E8", "Here is the summary …<|close|>response<|sep|>" + END,
     True, None, None, "Here is the summary …", []),
    ("E9", "I should look it up.<|open|>tools<|sep|>" + xtml_call('tool="get_weather"', ("city", "string", "Oslo"))
     + "<|close|>tools<|sep|>" + END,
     True, TOOLS, "I should look it up.", None, [call("get_weather", '{"city": "Oslo"}')]),
    ("F1", "Sum is easy." + THINK_END + "4<|close|>response<|sep|>" + END, True, None, "Sum is easy.", "4", []),
    ("F2", "Hi there!<|close|>response<|sep|>" + END, False, None, None, "Hi there!", []),
    ("F3", 'Need weather.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
     '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
     '<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
     '<|close|>call<|sep|><|close|>tools<|sep|>' + END,
     True, TOOLS, "Need weather.", None, [call("get_weather", '{"city": "Paris", "days": 3}')]),
    ("F4", '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="search" index="1"<|sep|>'
     '<|open|>argument key="q" type="string"<|sep|>say "hi" & bye<|close|>argument<|sep|>'
     '<|open|>argument key="opts" type="object"<|sep|>{"limit": 5}<|close|>argument<|sep|><|close|>call<|sep|>'
     '<|open|>call tool="a&amp;b" index="2"<|sep|><|open|>argument key="flag" type="boolean"<|sep|>false'
     '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>' + END,
     False, TOOLS, None, None,
     [call("search", '{"q": "say \\"hi\\" & bye", "opts": {"limit": 5}}'), call("a&b", '{"flag": false}')]),
    ("F5", "Plan." + THINK_END + "Looking.<|close|>response<|sep|><|open|>tools<|sep|>"
     + xtml_call('tool="f"', closed=False) + '<|open|>argument key="x" type="string"<|sep|>ab',
     True, TOOLS, "Plan.", "Looking.", []),
    ("F6", "Plan." + THINK_END + "<|close|>response<|sep|><|open|>tools<|sep|>"
     + xtml_call('tool="f"', ("n", "number", "3,"), ("m", "number", "7")) + "<|close|>tools<|sep|>" + END,
     True, TOOLS, "Plan.", None, [call("f", '{"n": "3,", "m": 7}')]),
    ("F7", "Plan." + THINK_END + "<|close|>response<|sep|><|open|>tools<|sep|>"
     + xtml_call('index="0"', ("x", "string", "1")) + xtml_call('tool="g"', ("y", "null", "null"))
     + "<|close|>tools<|sep|>" + END,
     True, TOOLS, "Plan.", None, [call("g", '{"y": null}')]),
    ("F8", "Answer text<|close|>response<|sep|>" + END, True, None, None, "Answer text", []),
    ("F9", "Check the map.<|open|>tools<|sep|>" + xtml_call('tool="get_weather"', ("days", "number", "2"))
     + "<|close|>tools<|sep|>" + END,
     True, TOOLS, "Check the map.", None, [call("get_weather", '{"days": 2}')]),
]

# Spec 5.4's failure modes beyond the examples above: each yields no tool calls and never raises.
FAILURES = [
    ("call never closed before tools close", "R." + THINK_END + "<|close|>response<|sep|><|open|>tools<|sep|>"
     + xtml_call('tool="f"', ("x", "string", "1"), closed=False) + "<|close|>tools<|sep|>" + END,
     True, TOOLS, "R.", None, []),
    ("request without tools: the tools channel is not content", "R." + THINK_END + "Sure.<|close|>response<|sep|>"
     "<|open|>tools<|sep|>" + xtml_call('tool="f"') + "<|close|>tools<|sep|>" + END,
     True, None, "R.", "Sure.", []),
    ("special tokens stripped by the serving path: no marker matches",
     'Need weather.thinkresponseresponsetoolscall tool="get_weather" index="1"callmessage',
     True, TOOLS, 'Need weather.thinkresponseresponsetoolscall tool="get_weather" index="1"callmessage', None, []),
    ("string value with a literal argument close ends the element early (documented limitation)",
     "R." + THINK_END + "<|close|>response<|sep|><|open|>tools<|sep|>"
     + xtml_call('tool="f"', ("x", "string", "a<|close|>argument<|sep|>b")) + "<|close|>tools<|sep|>" + END,
     True, TOOLS, "R.", None, [call("f", '{"x": "a"}')]),
    ("truncated inside the reasoning: all of it is reasoning", "Still thinking about i", True, TOOLS,
     "Still thinking about i", None, []),
    ("truncated inside a marker", "Done." + THINK_END + "Yes<|close|>resp", True, None, "Done.", "Yes<|close|>resp", []),
    ("whitespace-only channels are null", " \n" + THINK_END + "\n\n<|close|>response<|sep|>" + END,
     True, None, None, None, []),
]

CASES = EXAMPLES + FAILURES
IDS = [case[0] for case in CASES]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3-tiny")
    synth.write_tokenizer(out, K3Config.from_hf_dict(PRESETS["k3-tiny"]))
    return Tokenizer.from_dir(out)


@pytest.mark.parametrize("name, text, thinking, tools, reasoning, content, calls", CASES, ids=IDS)
def test_parse_output(name, text, thinking, tools, reasoning, content, calls):
    parsed = parse_output(text, thinking=thinking, tools=tools)
    assert (parsed.reasoning_content, parsed.content, parsed.tool_calls) == (reasoning, content, calls)
    for parsed_call in parsed.tool_calls:
        assert isinstance(json.loads(parsed_call["arguments"]), dict)


def test_calls_need_tools_in_the_request():
    text = EXAMPLES[2][1]
    assert parse_output(text, tools=[]).tool_calls == []
    # Any name counts once the request has tools (SGLang's reading).
    assert parse_output(text, tools=[{"type": "function", "function": {"name": "other"}}]).tool_calls


def test_repeated_think_opener_is_not_reasoning():
    parsed = parse_output("<|open|>think<|sep|>Hmm." + THINK_END + "Ok." + END)
    assert (parsed.reasoning_content, parsed.content) == ("Hmm.", "Ok.")


def test_instant_mode_has_reasoning_only_when_the_model_closes_a_think_channel():
    # SGLang's reading: a think close in instant mode means the model thought anyway, and leaving
    # the marker in the content would show markup (tests/serve/test_chat_parsing_sglang.py).
    parsed = parse_output("Plain.<|close|>think<|sep|>answer", thinking=False)
    assert (parsed.reasoning_content, parsed.content) == ("Plain.", "answer")
    parsed = parse_output("Plain answer.<|close|>response<|sep|>", thinking=False)
    assert (parsed.reasoning_content, parsed.content) == (None, "Plain answer.")


def test_fragments_of_markers_never_raise():
    rng = random.Random(0)
    fragments = ["<|open|>", "<|close|>", "<|sep|>", "think", "response", "tools", "call", "argument", "message",
                 ' tool="f"', ' key="k"', ' type="number"', ' type="object"', "{", '"', "x", " ", "<|", "|>"]
    for _ in range(500):
        text = "".join(rng.choice(fragments) for _ in range(rng.randrange(30)))
        for thinking in (True, False):
            parsed = parse_output(text, thinking=thinking, tools=TOOLS)
            assert all(isinstance(json.loads(c["arguments"]), dict) for c in parsed.tool_calls)


def stream(chunks, *, thinking, tools, stream_reasoning=False):
    """Joined deltas of a streaming parse, with the streamed calls checked for OpenAI's shape."""
    parser = OutputParser(thinking=thinking, tools=tools, stream_reasoning=stream_reasoning)
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    reasoning = "".join(d.reasoning_content or "" for d in deltas) or None
    content = "".join(d.content or "" for d in deltas) or None
    calls = [c for d in deltas for c in d.tool_calls]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    for streamed_call in calls:
        assert streamed_call["type"] == "function"
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", streamed_call["id"])
    assert len({c["id"] for c in calls}) == len(calls)
    return reasoning, content, [c["function"] for c in calls]


def splits(text, rng):
    """Every two-piece split, one character per piece, and random multi-piece splits."""
    yield from ([text[:i], text[i:]] for i in range(len(text) + 1))
    yield list(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
        yield [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]


def token_deltas(tokenizer, text):
    """The text as the server streams it: one detokenized delta per token (markers are single tokens)."""
    decoder = tokenizer.incremental_decoder()
    return [decoder.feed(i) for i in tokenizer.encode(text, allow_special=True)] + [decoder.finish()]


@pytest.mark.parametrize("name, text, thinking, tools, reasoning, content, calls", CASES, ids=IDS)
def test_stream_equals_parse_output_for_every_split(tokenizer, name, text, thinking, tools, reasoning, content,
                                                    calls):
    expected = (reasoning, content, calls)
    assert stream(token_deltas(tokenizer, text), thinking=thinking, tools=tools) == expected
    for chunks in splits(text, random.Random(name)):
        assert stream(chunks, thinking=thinking, tools=tools) == expected, chunks


SKIPPED_THINK = {"E8", "F8"}


@pytest.mark.parametrize("name, text, thinking, tools, reasoning, content, calls",
                         [case for case in CASES if case[0] not in SKIPPED_THINK],
                         ids=[name for name in IDS if name not in SKIPPED_THINK])
def test_live_reasoning_stream_equals_parse_output(tokenizer, name, text, thinking, tools, reasoning, content,
                                                   calls):
    expected = (reasoning, content, calls)
    for chunks in [token_deltas(tokenizer, text), *splits(text, random.Random(name))]:
        assert stream(chunks, thinking=thinking, tools=tools, stream_reasoning=True) == expected, chunks


@pytest.mark.parametrize("text", [case[1] for case in CASES if case[0] in SKIPPED_THINK], ids=sorted(SKIPPED_THINK))
def test_live_reasoning_stream_reports_a_skipped_think_channel_as_reasoning(tokenizer, text):
    """The one place a live reasoning stream and parse_output differ: the text was sent as
    reasoning before the response close showed the think channel had been skipped."""
    before_close = text[:text.index("<|close|>response<|sep|>")]
    for chunks in [token_deltas(tokenizer, text), *splits(text, random.Random(0))]:
        assert stream(chunks, thinking=True, tools=None, stream_reasoning=True) == (before_close, None, [])


def test_stream_holds_only_what_could_be_a_marker():
    parser = OutputParser(thinking=True)
    assert parser.feed("Let me think<|clo").reasoning_content == "Let me think"
    assert not parser.feed("se|>th")
    delta = parser.feed("ink<|sep|><|open|>response<|sep|>4 <")
    assert (delta.reasoning_content, delta.content) == (None, "4 ")
    assert parser.feed("3").content == "<3"
    held = OutputParser(thinking=True, stream_reasoning=False)
    assert not held.feed("Let me think")
    assert held.feed(THINK_END + "ok").reasoning_content == "Let me think"


def test_a_call_is_streamed_whole_when_it_closes():
    parser = OutputParser(thinking=False, tools=TOOLS)
    assert parser.feed("<|close|>response<|sep|><|open|>tools<|sep|>" + xtml_call('tool="f"', ("x", "number", "1"),
                                                                                   closed=False)).tool_calls == []
    (streamed,) = parser.feed("<|close|>call<|sep|>").tool_calls
    assert streamed["function"] == call("f", '{"x": 1}') and streamed["index"] == 0
