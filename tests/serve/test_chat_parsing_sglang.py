"""The output parser against SGLang 0.5.23's K3 parsers (`srt/parser/reasoning_parser.py`'s
KimiK3Detector and `srt/function_call/kimik3_detector.py`), case by case: generation cut at every
marker boundary, markers written literally in text and arguments, thinking in instant mode and
malformed calls. Each case's expected parse is SGLang's non-streaming result, except where the
`sglang` column gives SGLang's own: there it leaks markup into content (the tools channel of a
request that declared no tools, stop-token text, an unclosed marker) or loses text, and the clean
reading is taken. Streaming, split anywhere, joins to the same parse."""

import random
import re

import pytest

from serve.chat import parse_output
from tests.serve.test_chat_parsing import CASES as SPEC_CASES
from tests.serve.test_chat_parsing import splits, stream, token_deltas, tokenizer  # noqa: F401 (a fixture)

TC, RO, RC = "<|close|>think<|sep|>", "<|open|>response<|sep|>", "<|close|>response<|sep|>"
TO, TCL, M = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>", "<|close|>message<|sep|>"
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def arg(key, kind, value):
    return f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'


def xcall(attrs, *arguments, closed=True):
    return f"<|open|>call{attrs}<|sep|>" + "".join(arguments) + ("<|close|>call<|sep|>" if closed else "")


def calls(*pairs):
    return [{"name": name, "arguments": arguments} for name, arguments in pairs]


TOOLS_TURN = "R" + TC + RC + TO  # reasoning "R", an empty response, then the tools channel

# (name, generated text, thinking, tools, reasoning_content, content, tool_calls, SGLang's parse where it differs)
CASES = [
    # Generation stopped inside a marker: each marker is three tokens, so it can stop after
    # `<|open|>` / `<|close|>` or after the channel's name, and what is left is markup.
    ("reply cut after <|close|>", "Reply.<|close|>", False, None, None, "Reply.", [], None),
    ("reply cut after <|close|>, thinking", "Plan." + TC + RO + "Reply.<|close|>", True, None, "Plan.", "Reply.", [],
     None),
    ("reply cut after <|open|>tools", "Reply.<|open|>tools", False, TOOLS, None, "Reply.", [], None),
    ("reply cut after the next opener", "Reply." + RC + "<|open|>", False, TOOLS, None, "Reply.", [], None),
    ("reply cut after <|close|>message", "Reply." + RC + "<|close|>message", False, None, None, "Reply.", [], None),
    ("reasoning cut after <|close|>think", "Plan it.<|close|>think", True, None, "Plan it.", None, [], None),
    ("reasoning cut after <|close|>", "Plan it.<|close|>", True, None, "Plan it.", None, [], None),
    ("reasoning cut after <|open|>response", "Plan it." + TC + "<|open|>response", True, None, "Plan it.", None, [],
     None),
    ("reasoning cut after <|open|>tools", "Plan it.<|open|>tools", True, TOOLS, "Plan it.", None, [], None),
    ("cut inside the repeated think opener", "<|open|>think", True, None, None, None, [], ("<|open|>think", None, [])),
    ("a marker's start followed by text is text", "Done." + TC + "a<|close|>b", True, None, "Done.", "a<|close|>b", [],
     None),
    # Markers written literally: the detokenized text cannot tell them from real ones, so the
    # channels are decided by what follows.
    ("response opener inside the reasoning", "I write " + RO + " later." + TC + RO + "Ans" + RC + M, True, None,
     "I write " + RO + " later.", "Ans", [], None),
    ("response opener without a think close opens the response", "A" + RO + "B" + RC + M, True, None, "A", "B", [],
     None),
    ("response close inside the reasoning", "Ends with " + RC + " then." + TC + RO + "Ok" + RC + M, True, None,
     "Ends with " + RC + " then.", "Ok", [], (None, "Ok", [])),
    ("think close inside the response", TC + RO + "Use " + TC + " to end." + RC + M, True, None,
     None, "Use " + TC + " to end.", [], None),
    ("call opener inside a string argument",
     TOOLS_TURN + xcall(' tool="f" index="1"', arg("x", "string", 'see <|open|>call tool="g"<|sep|> here')) + TCL + M,
     True, TOOLS, "R", None, calls(("f", '{"x": "see <|open|>call tool=\\"g\\"<|sep|> here"}')), None),
    ("call close inside a string argument ends the call there",
     TOOLS_TURN + xcall(' tool="f" index="1"', arg("x", "string", "a<|close|>call<|sep|>b")) + TCL + M,
     True, TOOLS, "R", None, calls(("f", "{}")), None),
    # Thinking in instant mode (the prompt opened the response channel).
    ("instant mode, think opener first", "<|open|>think<|sep|>Hmm" + TC + RO + "Hi" + RC + M, False, None, "Hmm", "Hi",
     [], None),
    ("instant mode, think close", "Plan." + TC + RO + "Hi" + RC + M, False, None, "Plan.", "Hi", [], None),
    ("instant mode, think close then text", "Plain." + TC + "answer", False, None, "Plain.", "answer", [], None),
    ("instant mode, think close after the response close", "A" + RC + "B" + TC + "C", False, None, None, "ABC", [],
     None),
    # Malformed calls.
    ("unfinished call before a finished one",
     TOOLS_TURN + xcall(' tool="f" index="1"', arg("x", "number", "1"), closed=False)
     + xcall(' tool="g" index="2"', arg("y", "number", "2")) + TCL + M,
     True, TOOLS, "R", None, calls(("f", '{"x": 1, "y": 2}')), None),
    ("argument without a key",
     TOOLS_TURN + xcall(' tool="f"', '<|open|>argument type="string"<|sep|>v<|close|>argument<|sep|>',
                        arg("k", "string", "w")) + TCL + M,
     True, TOOLS, "R", None, calls(("f", '{"k": "w"}')), ("R", None, calls(("f", '{"": "v", "k": "w"}')))),
    ("call without attributes", TOOLS_TURN + xcall("", arg("x", "string", "1")) + TCL + M, True, TOOLS, "R", None, [],
     None),
    ("argument without a type is a string",
     TOOLS_TURN + xcall(' tool="f"', '<|open|>argument key="n"<|sep|>3<|close|>argument<|sep|>') + TCL + M,
     True, TOOLS, "R", None, calls(("f", '{"n": "3"}')), None),
    ("tools channel never closed", TOOLS_TURN + xcall(' tool="f"', arg("n", "number", "3")), True, TOOLS, "R", None,
     calls(("f", '{"n": 3}')), None),
    # Where SGLang leaks markup.
    ("no tools declared: the tools channel is not content",
     "R" + TC + RO + "Sure." + RC + TO + xcall(' tool="f"') + TCL + M, True, None, "R", "Sure.", [],
     ("R", "Sure." + TO + xcall(' tool="f"') + TCL + M, [])),
    ("stop-token text ends the reply", "Reply.[EOS]", False, None, None, "Reply.", [], (None, "Reply.[EOS]", [])),
    ("stop-token text ends the reasoning", "Thinking[EOT]", True, None, "Thinking", None, [],
     ("Thinking[EOT]", None, [])),
    ("end of message ends the reasoning", "Thinking<|end_of_msg|>", True, None, "Thinking", None, [],
     ("Thinking<|end_of_msg|>", None, [])),
    ("message close before any think close: the think channel was skipped", "Answer" + M, True, None, None, "Answer",
     [], ("Answer" + M, None, [])),
]
IDS = [case[0] for case in CASES]
PARAMS = "name, text, thinking, tools, reasoning, content, tool_calls, sglang"


@pytest.mark.parametrize(PARAMS, CASES, ids=IDS)
def test_parse_output(name, text, thinking, tools, reasoning, content, tool_calls, sglang):
    parsed = parse_output(text, thinking=thinking, tools=tools)
    assert (parsed.reasoning_content, parsed.content, parsed.tool_calls) == (reasoning, content, tool_calls)
    assert sglang != (reasoning, content, tool_calls)  # a difference noted is a difference


@pytest.mark.parametrize(PARAMS, CASES, ids=IDS)
def test_stream_equals_parse_output_for_every_split(tokenizer, name, text, thinking, tools, reasoning, content,
                                                    tool_calls, sglang):
    expected = (reasoning, content, tool_calls)
    assert stream(token_deltas(tokenizer, text), thinking=thinking, tools=tools) == expected
    for chunks in splits(text, random.Random(name)):
        assert stream(chunks, thinking=thinking, tools=tools) == expected, chunks


# A live reasoning stream sends text before it knows its channel in two cases: reasoning later shown
# to be a skipped think channel's response (E8), and instant-mode content later shown to be
# reasoning. The sent text stays where it went; the marker is dropped.
LIVE = {
    "message close before any think close: the think channel was skipped": ("Answer", None, []),
    "instant mode, think close": (None, "Plan.Hi", []),
    "instant mode, think close then text": (None, "Plain.answer", []),
}


@pytest.mark.parametrize(PARAMS, CASES, ids=IDS)
def test_live_reasoning_stream(tokenizer, name, text, thinking, tools, reasoning, content, tool_calls, sglang):
    expected = LIVE.get(name, (reasoning, content, tool_calls))
    for chunks in [token_deltas(tokenizer, text), *splits(text, random.Random(name))]:
        assert stream(chunks, thinking=thinking, tools=tools, stream_reasoning=True) == expected, chunks


# The model's tokens at the marker level: a special token, a word, a run of spaces or of punctuation.
MARKER_LEVEL_TOKEN = re.compile(r"<\|\w+\|>|\w+|\s+|[^\w\s<]+|<")
ALL_CASES = [case[:7] for case in SPEC_CASES + CASES]


@pytest.mark.parametrize("name, text, thinking, tools, reasoning, content, tool_calls", ALL_CASES,
                         ids=[case[0] for case in ALL_CASES])
def test_cut_at_every_token_boundary(tokenizer, name, text, thinking, tools, reasoning, content, tool_calls):
    """Generation stopped after any token leaves no markup behind that the whole text's parse does not
    have, its calls are the first of the whole text's, and streaming it gives the same parse."""
    for cut in (m.end() for m in MARKER_LEVEL_TOKEN.finditer(text)):
        prefix = text[:cut]
        parsed = parse_output(prefix, thinking=thinking, tools=tools)
        for got, whole in ((parsed.reasoning_content, reasoning), (parsed.content, content)):
            for marker in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"):
                assert (got or "").count(marker) <= (whole or "").count(marker), (prefix, got)
        assert parsed.tool_calls == tool_calls[:len(parsed.tool_calls)], prefix
        expected = (parsed.reasoning_content, parsed.content, parsed.tool_calls)
        assert stream(token_deltas(tokenizer, prefix), thinking=thinking, tools=tools) == expected, prefix
        assert stream([prefix[:cut // 2], prefix[cut // 2:]], thinking=thinking, tools=tools) == expected, prefix
