"""Reasoning, content and tool calls out of K3's generated text.

The text is what the model generated after the prompt's channel opener, detokenized with special
tokens kept and no spaces added around them. Its shape is

    [reasoning <|close|>think<|sep|>] [<|open|>response<|sep|>] content [<|close|>response<|sep|>]
    [<|open|>tools<|sep|> <|open|>call tool="NAME" index="1"<|sep|> arguments <|close|>call<|sep|> …
     <|close|>tools<|sep|>] <|close|>message<|sep|>

Content is the text after the reasoning and before the tools channel, without the response
wrappers; text after the message close is not part of the message. One incremental parser does
both jobs: `OutputParser` streams, and `parse_output` feeds it the whole text at once, so the two
agree for any split of the stream (exactly so when the stream holds reasoning back, see E8 below).
Where vLLM 0.33 and SGLang differ, SGLang's reading is taken:

* thinking mode, no think close, but a response or tools opener: the reasoning ends there, and the
  calls count (E9);
* thinking mode, a response close before any think close: the model skipped the think channel and
  everything was the response (E8). A stream cannot know this until the close arrives, so a parser
  that streams reasoning live (`stream_reasoning=True`) reports such text as reasoning instead;
* a tool call counts once its `<|close|>call<|sep|>` has arrived, and only when the request had
  tools; a truncated or nameless call is dropped, the text around it kept. Nothing here raises.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

THINK_OPEN = "<|open|>think<|sep|>"
THINK_CLOSE = "<|close|>think<|sep|>"
RESPONSE_OPEN = "<|open|>response<|sep|>"
RESPONSE_CLOSE = "<|close|>response<|sep|>"
TOOLS_OPEN = "<|open|>tools<|sep|>"
TOOLS_CLOSE = "<|close|>tools<|sep|>"
CALL_CLOSE = "<|close|>call<|sep|>"
MESSAGE_CLOSE = "<|close|>message<|sep|>"
END_OF_MESSAGE = "<|end_of_msg|>"

# What ends the reasoning, in thinking mode. The first two mean the think channel was skipped.
_REASONING_ENDS = (THINK_CLOSE, RESPONSE_OPEN, TOOLS_OPEN, RESPONSE_CLOSE, MESSAGE_CLOSE)
_SKIPPED_THINK = (RESPONSE_CLOSE, MESSAGE_CLOSE)
# Markers met in the response: the response wrappers are dropped, the others end the content.
_RESPONSE_MARKERS = (RESPONSE_OPEN, RESPONSE_CLOSE, TOOLS_OPEN, MESSAGE_CLOSE, END_OF_MESSAGE)
_TOOLS_MARKERS = (CALL_CLOSE, TOOLS_CLOSE, MESSAGE_CLOSE, END_OF_MESSAGE)

_CALL_HEADER = re.compile(r"<\|open\|>call\b(?P<attrs>(?:(?!<\|sep\|>).)*)<\|sep\|>", re.DOTALL)
_ARGUMENT = re.compile(r"<\|open\|>argument\b(?P<attrs>(?:(?!<\|sep\|>).)*)<\|sep\|>"
                       r"(?P<value>.*?)<\|close\|>argument<\|sep\|>", re.DOTALL)
_ATTRIBUTE = re.compile(r'(\w+)="([^"]*)"')


def make_tool_call_id() -> str:
    """An OpenAI tool-call id as vLLM makes them for K3: `chatcmpl-tool-` and 16 random hex digits."""
    return f"chatcmpl-tool-{secrets.token_hex(8)}"


@dataclass
class ParsedOutput:
    reasoning_content: str | None
    content: str | None
    tool_calls: list[dict]  # {"name": str, "arguments": JSON object string}


@dataclass
class Delta:
    """What one `feed` adds, in OpenAI's streaming `delta` shape: text deltas (None when nothing
    new) and the calls completed by this feed, each whole, as
    {"index", "id", "type": "function", "function": {"name", "arguments"}}."""
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.reasoning_content is not None or self.content is not None or bool(self.tool_calls)


def parse_output(text: str, *, thinking: bool = True, tools: list | None = None) -> ParsedOutput:
    """Splits a whole generation. `thinking` says whether the prompt ended in the think opener;
    calls are parsed only when `tools` (the request's tool list) is non-empty."""
    parser = OutputParser(thinking=thinking, tools=tools, stream_reasoning=False)
    first, last = parser.feed(text), parser.finish()
    reasoning = (first.reasoning_content or "") + (last.reasoning_content or "")
    content = (first.content or "") + (last.content or "")
    calls = [call["function"] for call in first.tool_calls + last.tool_calls]
    return ParsedOutput(reasoning or None, content or None, calls)


class _Channel:
    """The text of one channel as it streams. Leading whitespace waits for a visible character, so
    a channel that never gets one stays None (whitespace-only content is null, as the hosted API returns it)."""

    def __init__(self):
        self._leading_whitespace = ""
        self._started = False

    def add(self, text: str) -> str:
        if self._started:
            return text
        self._leading_whitespace += text
        if not self._leading_whitespace.strip():
            return ""
        self._started = True
        return self._leading_whitespace


class OutputParser:
    """Streaming parser: `feed` each text delta as detokenized (special tokens kept), then `finish`.

    Text that might be the start of a marker is held until the marker completes or cannot. With
    `stream_reasoning=False`, reasoning is held until the think channel ends, which is what makes
    a skipped think channel (E8) come out as content, as in `parse_output`."""

    def __init__(self, *, thinking: bool = True, tools: list | None = None, stream_reasoning: bool = True):
        self._parse_calls = bool(tools)
        self._stream_reasoning = stream_reasoning
        self._step = self._reasoning_step if thinking else self._response_step
        self._at_reasoning_start = True
        self._buffer = ""  # text not yet assigned to a channel
        self._unreleased_reasoning = ""  # with stream_reasoning=False: reasoning not yet sent
        self._reasoning = _Channel()
        self._content = _Channel()
        self._num_calls = 0
        self._tools_scanned = 0  # no tools-channel marker starts before this point of the buffer

    def feed(self, text: str) -> Delta:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> Delta:
        """Whatever was held at the end of the generation; an unfinished tool call is dropped."""
        return self._run(final=True)

    def _run(self, final: bool) -> Delta:
        delta = _DeltaText()
        while self._step(delta, final):
            pass
        return delta.to_delta()

    # Each step consumes what it can from the buffer and returns whether to step again.

    def _reasoning_step(self, delta: _DeltaText, final: bool) -> bool:
        if self._at_reasoning_start:
            # The model may repeat the think opener that ended the prompt.
            if self._buffer.startswith(THINK_OPEN):
                self._buffer = self._buffer[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(self._buffer) and not final:
                return False
            self._at_reasoning_start = False
        at, marker = _first_marker(self._buffer, _REASONING_ENDS)
        if marker is None:
            self._add_reasoning(self._take_text(_REASONING_ENDS, final), delta)
            if final:
                self._release_reasoning(delta)
            return False
        if marker in _SKIPPED_THINK and not self._stream_reasoning:
            # E8: nothing was reasoning; all the text so far goes to the response.
            self._buffer = self._unreleased_reasoning + self._buffer
            self._unreleased_reasoning = ""
        else:
            self._add_reasoning(self._buffer[:at], delta)
            self._release_reasoning(delta)
            # The response step drops or acts on every marker here but the think close.
            self._buffer = self._buffer[at + len(THINK_CLOSE):] if marker == THINK_CLOSE else self._buffer[at:]
        self._step = self._response_step
        return True

    def _take_text(self, markers: tuple[str, ...], final: bool) -> str:
        """The buffered text, less an end that could still grow into one of `markers`."""
        cut = len(self._buffer) - (0 if final else _partial_marker_length(self._buffer, markers))
        text, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return text

    def _add_reasoning(self, text: str, delta: _DeltaText) -> None:
        if self._stream_reasoning:
            delta.reasoning += self._reasoning.add(text)
        else:
            self._unreleased_reasoning += text

    def _release_reasoning(self, delta: _DeltaText) -> None:
        delta.reasoning += self._reasoning.add(self._unreleased_reasoning)
        self._unreleased_reasoning = ""

    def _response_step(self, delta: _DeltaText, final: bool) -> bool:
        at, marker = _first_marker(self._buffer, _RESPONSE_MARKERS)
        if marker is None:
            delta.content += self._content.add(self._take_text(_RESPONSE_MARKERS, final))
            return False
        delta.content += self._content.add(self._buffer[:at])
        self._buffer = self._buffer[at + len(marker):]
        if marker == TOOLS_OPEN:
            self._step = self._tools_step
        elif marker in (MESSAGE_CLOSE, END_OF_MESSAGE):
            self._step = self._done_step
        return True

    def _tools_step(self, delta: _DeltaText, final: bool) -> bool:
        # A call is buffered whole, so searching only the new text keeps a long call linear.
        at, marker = _first_marker(self._buffer, _TOOLS_MARKERS, start=self._tools_scanned)
        if marker is None:
            self._tools_scanned = max(0, len(self._buffer) - max(map(len, _TOOLS_MARKERS)) + 1)
            return False  # an unfinished call waits for its close, and is dropped if none comes
        call_text, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
        self._tools_scanned = 0
        if marker != CALL_CLOSE:
            self._step = self._done_step
        elif self._parse_calls and (call := _parse_call(call_text)) is not None:
            delta.tool_calls.append({"index": self._num_calls, "id": make_tool_call_id(), "type": "function",
                                     "function": call})
            self._num_calls += 1
        return True

    def _done_step(self, delta: _DeltaText, final: bool) -> bool:
        self._buffer = ""  # text after the message close is not part of the message
        return False


@dataclass
class _DeltaText:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def to_delta(self) -> Delta:
        return Delta(self.reasoning or None, self.content or None, self.tool_calls)


def _first_marker(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """Position and text of the earliest marker in `text[start:]`, or (-1, None)."""
    found = [(at, marker) for marker in markers if (at := text.find(marker, start)) != -1]
    return min(found) if found else (-1, None)


def _partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could grow into one of `markers`."""
    for start in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        if text[start] == "<" and any(marker.startswith(text[start:]) for marker in markers):
            return len(text) - start
    return 0


def _parse_call(text: str) -> dict | None:
    """{"name", "arguments"} of one call element (`text` up to its close), or None when it has no
    `tool` attribute. Arguments are re-typed by their `type` attribute: strings are raw text,
    anything else is JSON, kept as the raw string when it does not parse (E6)."""
    headers = list(_CALL_HEADER.finditer(text))
    header = headers[-1] if headers else None  # an earlier opener would be a call left unfinished
    name = _attributes(header["attrs"]).get("tool") if header else None
    if not name:
        return None
    arguments = {}
    for argument in _ARGUMENT.finditer(text, header.end()):
        attrs = _attributes(argument["attrs"])
        if "key" not in attrs:
            continue
        value = argument["value"]
        if attrs.get("type", "string") != "string":
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        arguments[attrs["key"]] = value
    return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


def _attributes(text: str) -> dict[str, str]:
    # Reverses the encoder's escaping (`&` first, then `"`), so `&quot;` must be undone first.
    return {key: value.replace("&quot;", '"').replace("&amp;", "&") for key, value in _ATTRIBUTE.findall(text)}
