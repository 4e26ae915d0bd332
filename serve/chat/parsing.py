"""Reasoning, content and tool calls out of K3's generated text.

The text is what the model generated after the prompt's channel opener, detokenized with special
tokens kept and no spaces added around them. Its shape is

    [reasoning <|close|>think<|sep|>] [<|open|>response<|sep|>] content [<|close|>response<|sep|>]
    [<|open|>tools<|sep|> <|open|>call tool="NAME" index="1"<|sep|> arguments <|close|>call<|sep|> …
     <|close|>tools<|sep|>] <|close|>message<|sep|>

Content is the text after the reasoning and before the tools channel, without the response
wrappers; the message ends at its close, at `<|end_of_msg|>` or at the text of a stop token
(`[EOS]`, `[EOT]`), and what follows is not part of it. One incremental parser does both jobs:
`OutputParser` streams, and `parse_output` feeds it the whole text at once, so the two agree for
any split of the stream (exactly so when the stream holds back text whose channel is not yet
known, see below). The channels follow SGLang 0.5.23's K3 parsers, whose reading differs from
vLLM 0.33's where the model strays from the shape above:

* thinking mode: the first think close ends the reasoning. A response opener before it was
  written inside the reasoning if a think close still follows, and opened the response if none
  does; likewise a response close, which with no think close after it means the model skipped
  the think channel and everything was the response (E8), as does a message close. A tools
  opener ends the reasoning at once and its calls count (E9);
* instant mode: a think opener at the start, or a think close before the reply's own close, means
  the model thought anyway, and the text before the close is reasoning;
* generation can stop inside a marker (three tokens: `<|open|>` or `<|close|>`, a name, `<|sep|>`);
  a trailing `<|open|>` or `<|close|>`, alone or with a channel's name, is dropped as markup;
* a tool call counts once its `<|close|>call<|sep|>` has arrived, and only when the request had
  tools; it is headed by its first call opener, so one written inside an argument stays text. A
  truncated or nameless call is dropped, the text around it kept. Nothing here raises.

Two readings of SGLang's are not taken, because they put markup in the content: the tools channel
of a request without tools is dropped rather than shown raw, and a stop token's text ends the
message rather than staying in it. Whitespace-only channels are None.

A parser that streams reasoning live (`stream_reasoning=True`) must send text before the marker
that decides its channel arrives: reasoning later shown to be a skipped think channel stays
reasoning, and instant-mode content later shown to be reasoning stays content (its think close is
dropped). Held streams (`stream_reasoning=False`) wait, and match `parse_output` exactly.
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

# Each of these ends the message: its close, or a stop token whose text the detokenizer kept.
_MESSAGE_ENDS = (MESSAGE_CLOSE, END_OF_MESSAGE, "[EOS]", "[EOT]")
# The special tokens this parser reads: kept in the text it is given whatever skip_special_tokens says
# (never spaced), while other special tokens (reserved ids, media tokens) are dropped from it.
FORMAT_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", END_OF_MESSAGE, "[EOS]", "[EOT]")
# What ends the reasoning, in thinking mode (see the module docstring for what each means).
_REASONING_ENDS = (THINK_CLOSE, TOOLS_OPEN, RESPONSE_OPEN, RESPONSE_CLOSE, *_MESSAGE_ENDS)
# After a response opener met in the reasoning: what shows whether that opener was real.
_OPENER_TESTS = (THINK_CLOSE, TOOLS_OPEN, *_MESSAGE_ENDS)
# Instant mode, before the reply shows its shape: a think close first means the model thought anyway.
_INSTANT_TESTS = (THINK_CLOSE, RESPONSE_CLOSE, TOOLS_OPEN, *_MESSAGE_ENDS)
_TOOLS_MARKERS = (CALL_CLOSE, TOOLS_CLOSE, *_MESSAGE_ENDS)
# Generation cut right after `<|open|>` or `<|close|>`, or after a channel name, leaves the start of a
# marker (each is three tokens) that can never complete; it is markup, not text.
_CUT_MARKER = re.compile(r"<\|(?:open|close)\|>(?:think|response|tools|message)?\Z")

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

    Text that might be the start of a marker is held until the marker completes or cannot, and so is
    text whose channel a later marker decides (after a response opener inside the reasoning). With
    `stream_reasoning=False`, reasoning is held until the think channel ends, and instant-mode text
    until the reply shows its shape, which is what makes a skipped think channel (E8) come out as
    content and thinking in instant mode come out as reasoning, as in `parse_output`."""

    def __init__(self, *, thinking: bool = True, tools: list | None = None, stream_reasoning: bool = True):
        self._parse_calls = bool(tools)
        self._stream_reasoning = stream_reasoning
        self._thinking = thinking
        self._step = self._start_step
        self._buffer = ""  # text not yet assigned to a channel
        self._scanned = 0  # steps that hold the whole buffer: no marker of theirs starts before this
        self._unreleased_reasoning = ""  # with stream_reasoning=False: reasoning not yet sent
        self._reasoning = _Channel()
        self._content = _Channel()
        # In instant mode the response has no think close of its own: one there is dropped as markup.
        self._response_markers = (RESPONSE_OPEN, RESPONSE_CLOSE, TOOLS_OPEN, *_MESSAGE_ENDS,
                                  *(() if thinking else (THINK_CLOSE,)))
        self._num_calls = 0

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

    def _go(self, step) -> bool:
        self._step, self._scanned = step, 0
        return True

    # Each step consumes what it can from the buffer and returns whether to step again.

    def _start_step(self, delta: _DeltaText, final: bool) -> bool:
        # A think opener first: the model repeated the prompt's (thinking mode) or thinks although
        # the prompt opened the response (instant mode). Either way, reasoning follows.
        if self._buffer.startswith(THINK_OPEN):
            self._buffer = self._buffer[len(THINK_OPEN):]
            self._response_markers = tuple(m for m in self._response_markers if m != THINK_CLOSE)
            return self._go(self._reasoning_step)
        if THINK_OPEN.startswith(self._buffer) and not final:
            return False
        if self._thinking:
            return self._go(self._reasoning_step)
        return self._go(self._response_step if self._stream_reasoning else self._instant_step)

    def _reasoning_step(self, delta: _DeltaText, final: bool) -> bool:
        at, marker = _first_marker(self._buffer, _REASONING_ENDS)
        if marker is None:
            self._add_reasoning(self._take_text(_REASONING_ENDS, final), delta)
            if final:
                self._release_reasoning(delta)
            return False
        if marker == MESSAGE_CLOSE:
            self._add_reasoning(self._buffer[:at], delta)
            self._buffer = self._buffer[at:]
            return self._skipped_think(delta)
        self._add_reasoning(self._buffer[:at], delta)
        if marker == RESPONSE_CLOSE:
            # Real, or written inside the reasoning: a think close still to come says which.
            self._buffer = self._buffer[at:]
            return self._go(self._response_close_step)
        self._release_reasoning(delta)
        if marker == THINK_CLOSE:
            self._buffer = self._buffer[at + len(marker):]
        elif marker == RESPONSE_OPEN:
            # Real, or written inside the reasoning: a think close still to come says which.
            self._buffer = self._buffer[at + len(marker):]
            return self._go(self._opener_step)
        else:
            self._buffer = self._buffer[at:]  # the response step acts on the marker
        return self._go(self._response_step)

    def _response_close_step(self, delta: _DeltaText, final: bool) -> bool:
        at, marker = _first_marker(self._buffer, _OPENER_TESTS, start=max(self._scanned, len(RESPONSE_CLOSE)))
        if marker is None and not final:
            self._scanned = _rescan_from(self._buffer, _OPENER_TESTS)
            return False
        if marker == THINK_CLOSE:  # the response close was text of the reasoning
            self._add_reasoning(self._buffer[:at], delta)
            self._release_reasoning(delta)
            self._buffer = self._buffer[at + len(marker):]
            return self._go(self._response_step)
        return self._skipped_think(delta)

    def _skipped_think(self, delta: _DeltaText) -> bool:
        """E8: the response or the message closed with no think close, so the think channel was
        skipped. Held reasoning goes back to the response; streamed reasoning stays sent."""
        self._buffer = self._unreleased_reasoning + self._buffer
        self._unreleased_reasoning = ""
        return self._go(self._response_step)

    def _opener_step(self, delta: _DeltaText, final: bool) -> bool:
        at, marker = _first_marker(self._buffer, _OPENER_TESTS, start=self._scanned)
        if marker is None and not final:
            self._scanned = _rescan_from(self._buffer, _OPENER_TESTS)
            return False
        if marker == THINK_CLOSE:  # the opener was text of the reasoning
            self._add_reasoning(RESPONSE_OPEN + self._buffer[:at], delta)
            self._release_reasoning(delta)
            self._buffer = self._buffer[at + len(marker):]
        return self._go(self._response_step)

    def _instant_step(self, delta: _DeltaText, final: bool) -> bool:
        at, marker = _first_marker(self._buffer, _INSTANT_TESTS, start=self._scanned)
        if marker is None and not final:
            self._scanned = _rescan_from(self._buffer, _INSTANT_TESTS)
            return False
        if marker == THINK_CLOSE:  # the model thought although the prompt opened the response
            self._add_reasoning(self._buffer[:at], delta)
            self._release_reasoning(delta)
            self._buffer = self._buffer[at + len(marker):]
            self._response_markers = tuple(m for m in self._response_markers if m != THINK_CLOSE)
        return self._go(self._response_step)

    def _take_text(self, markers: tuple[str, ...], final: bool) -> str:
        """The buffered text, less an end that could still grow into one of `markers`, or at the
        end of the generation, less the start of a marker that generation stopped inside."""
        if final:
            cut = _CUT_MARKER.search(self._buffer)
            text = self._buffer[:cut.start()] if cut else self._buffer
            self._buffer = ""
            return text
        cut = len(self._buffer) - _partial_marker_length(self._buffer, markers)
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
        at, marker = _first_marker(self._buffer, self._response_markers)
        if marker is None:
            delta.content += self._content.add(self._take_text(self._response_markers, final))
            return False
        delta.content += self._content.add(self._buffer[:at])
        self._buffer = self._buffer[at + len(marker):]
        if marker == TOOLS_OPEN:
            return self._go(self._tools_step)
        if marker in _MESSAGE_ENDS:
            return self._go(self._done_step)
        return True  # a response wrapper, dropped

    def _tools_step(self, delta: _DeltaText, final: bool) -> bool:
        # A call is buffered whole, so searching only the new text keeps a long call linear.
        at, marker = _first_marker(self._buffer, _TOOLS_MARKERS, start=self._scanned)
        if marker is None:
            self._scanned = _rescan_from(self._buffer, _TOOLS_MARKERS)
            return False  # an unfinished call waits for its close, and is dropped if none comes
        call_text, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
        self._scanned = 0
        if marker != CALL_CLOSE:
            return self._go(self._done_step)
        if self._parse_calls and (call := _parse_call(call_text)) is not None:
            delta.tool_calls.append({"index": self._num_calls, "id": make_tool_call_id(), "type": "function",
                                     "function": call})
            self._num_calls += 1
        return True

    def _done_step(self, delta: _DeltaText, final: bool) -> bool:
        self._buffer = ""  # text after the message's end is not part of the message
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


def _rescan_from(text: str, markers: tuple[str, ...]) -> int:
    """Where the next search for `markers` must start once `text` holds none: a marker may still
    end in text yet to come, so it starts at most one marker length back."""
    return max(0, len(text) - max(map(len, markers)) + 1)


def _partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could grow into one of `markers`."""
    firsts = {marker[0] for marker in markers}
    for start in range(_rescan_from(text, markers), len(text)):
        if text[start] in firsts and any(marker.startswith(text[start:]) for marker in markers):
            return len(text) - start
    return 0


def _parse_call(text: str) -> dict | None:
    """{"name", "arguments"} of one call element (`text` up to its close), or None when it has no
    `tool` attribute. Arguments are re-typed by their `type` attribute: strings are raw text,
    anything else is JSON, kept as the raw string when it does not parse (E6)."""
    # The first opener heads the call: a later one is text inside an argument value, or the opener
    # of a call left unfinished whose arguments then count for this one (SGLang's reading of both).
    header = _CALL_HEADER.search(text)
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
