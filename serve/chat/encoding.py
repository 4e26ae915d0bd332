"""K3 chat prompts in XTML (ARCHITECTURE.md, "Tokens").

Every element is `<|open|>NAME attr="v"<|sep|>` BODY `<|close|>NAME<|sep|>`, where `<|open|>`,
`<|close|>` and `<|sep|>` are special tokens and the name and attributes ordinary text. A turn is
one `message` element followed by `<|end_of_msg|>`:

    <|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>…<|close|>think<|sep|>
        <|open|>response<|sep|>…<|close|>response<|sep|>[<|open|>tools<|sep|>…<|close|>tools<|sep|>]
    <|close|>message<|sep|><|end_of_msg|>

The prompt ends with the assistant message opened and the first channel opened: `think` in
thinking mode, `response` in instant mode. Tool declarations, the thinking effort (in thinking
mode always: `max` when the request names none, the encoder's default), a forced tool choice and a
JSON response format are internal system messages (`role="system" type="..."`); the first two come
before the conversation, the last two after it.

The per-role framing and the texts of the internal messages are those of the checkpoint's encoder
(`encoding_k3.py`, not readable here; taken from a vLLM copy derived from it). A prompt
is rendered as pieces, each a special token or a segment of ordinary text, and each text segment is
tokenized on its own, as that encoder does, so BPE never merges across two segments: a tag's name
is one segment and an attribute four (` key`, `="`, the escaped value, `"`), and user text is one,
never scanned for special tokens, so `<|open|>` typed by a user stays text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from serve.chat.tokenizer import END_OF_MESSAGE, Tokenizer

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"  # one per image; the server expands it
THINKING_EFFORTS = ("low", "high", "max")
ROLES = ("system", "developer", "user", "assistant", "tool")

# The internal system messages, word for word as the model was trained on them. The effort text
# mentions `medium`, which the encoder rejects; that is the checkpoint's wording.
TOOL_DECLARATION = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
EXTRA_TOOL_DECLARATION = ("## New Tools Available\n"
                          "The system dynamically extends the toolset via lazy-loading.\n"
                          "You have access to all existing and extended tools.\n"
                          "Here are the specs for the extended tools.\n\n```json\n{}\n```")
THINKING_EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including "
                   "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                   "Now the system is invoked with `thinking_effort={}`.")
TOOL_CHOICE = "The system is invoked with `tool_choice={}`.\nYou MUST {} in the next message."
RESPONSE_FORMAT = ("The system is invoked with `response_format={}`.\nYour response must be raw JSON data without "
                   "markdown code blocks (```json) or any additional formatting.")
RESPONSE_SCHEMA = "\nThe JSON data must match the following schema:\n```json\n{}\n```"
DEFAULT_THINKING_EFFORT = "max"  # what the checkpoint's encoder renders when the request names none


@dataclass(frozen=True)
class Piece:
    """A special token (`special=True`, one id) or ordinary text (tokenized on its own)."""
    text: str
    special: bool = False


def encode_messages(messages: list[dict], **options) -> str:
    """The prompt as text (special tokens written out); `options` are those of `render_messages`.
    Raises ValueError naming the bad field."""
    return "".join(piece.text for piece in render_messages(messages, **options))


def tokenize_messages(tokenizer: Tokenizer, messages: list[dict], **options) -> list[int]:
    """The prompt as token ids, each text segment tokenized alone; `options` are those of `render_messages`."""
    ids = []
    for piece in render_messages(messages, **options):
        ids += [tokenizer.token_id(piece.text)] if piece.special else tokenizer.encode(piece.text)
    return ids


def render_messages(messages: list[dict], *, tools: list[dict] | None = None, thinking: bool = True,
                    add_generation_prompt: bool = True, thinking_effort: str | None = None,
                    tool_choice: Any = None, response_format: dict | None = None) -> list[Piece]:
    """The prompt as pieces. `tools` are OpenAI tool definitions; `thinking_effort` is one of
    THINKING_EFFORTS (rendered in thinking mode only, DEFAULT_THINKING_EFFORT when None);
    `tool_choice` "required" or "none" is stated to the model (other choices render nothing);
    `response_format` is OpenAI's request field: `{"type": "json_object"}` or `{"type": "json_schema",
    "json_schema": {"schema": ...}}` is stated to the model, `{"type": "text"}` renders nothing."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list")
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"thinking_effort: {thinking_effort!r} is not one of {', '.join(THINKING_EFFORTS)}")
    pieces = []
    if tools:
        pieces += _system_note("tool-declare", TOOL_DECLARATION.format(_tool_json(tools, "tools")))
    if thinking:
        pieces += _system_note("thinking-effort", THINKING_EFFORT.format(thinking_effort or DEFAULT_THINKING_EFFORT))
    for position, message in _with_tool_results_matched(messages):
        role = message["role"]
        field = f"messages[{position}]"
        if role in ("system", "developer") and message.get("tools"):
            # A system message may extend the toolset mid-conversation.
            tool_json = _tool_json(message["tools"], f"{field}.tools")
            pieces += _system_note("tool-declare", EXTRA_TOOL_DECLARATION.format(tool_json))
            if not message.get("content"):
                continue
        if role == "tool":
            attrs = [("role", "tool"), ("tool", message["tool"]), ("index", message["index"])]
        else:
            attrs = [("role", role if role in ("user", "assistant") else "system")]  # developer is system
            if message.get("name"):
                attrs.append(("name", message["name"]))
        if role == "assistant":
            body = _assistant_body(message, thinking, field)
        else:
            body = _content_pieces(message.get("content"), f"{field}.content")
        pieces += _element("message", attrs, body) + [Piece(END_OF_MESSAGE, True)]
    if tool_choice in ("required", "none"):
        must = "call tools" if tool_choice == "required" else "NOT call any tools"
        pieces += _system_note("tool-choice", TOOL_CHOICE.format(tool_choice, must))
    pieces += _response_format_note(response_format)
    if add_generation_prompt:
        pieces += _open_tag("message", [("role", "assistant")]) + _open_tag("think" if thinking else "response")
    return pieces


def rendered_order(messages: list[dict]) -> list[tuple[int, dict]]:
    """(position, message) in the order the prompt renders them (tool results in their calls' order):
    the order of the prompt's image placeholders, which serve/multimodal.py pairs with the images."""
    return _with_tool_results_matched(messages)


def _with_tool_results_matched(messages: list[dict]) -> list[tuple[int, dict]]:
    """(position in `messages`, message) with roles checked, and each run of tool results put in
    the order of the calls they answer, each given the call's `tool` name and 1-based `index`
    A result names its call by `tool_call_id`: the call's id, or the alias
    `"{name}:{zero-based position}"`; without one, the n-th result of a run answers the n-th call."""
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else None
            raise ValueError(f"messages[{position}].role: {role!r} is not one of {', '.join(ROLES)}")
    ordered = []
    calls = []  # (id, name) of each call of the latest assistant message
    for is_tool_run, group in groupby(enumerate(messages), key=lambda item: item[1]["role"] == "tool"):
        if not is_tool_run:
            for position, message in group:
                if message["role"] == "assistant":
                    calls = []
                    for i, call in enumerate(message.get("tool_calls") or []):
                        function = _call_function(call, f"messages[{position}].tool_calls[{i}]")
                        calls.append((call.get("id"), function["name"]))
                ordered.append((position, message))
            continue
        run = []  # (zero-based call position, message position, message)
        for position, message in group:
            run.append((_matched_call(message, position, calls, run), position, message))
        ordered += [(position, {**message, "tool": calls[call][1], "index": call + 1})
                    for call, position, message in sorted(run)]
    return ordered


def _matched_call(message: dict, position: int, calls: list[tuple], run: list[tuple]) -> int:
    """Zero-based position of the call that tool message `messages[position]` answers."""
    if not calls:
        raise ValueError(f"messages[{position}]: a tool message must follow an assistant message "
                         "with tool_calls")
    call_id = message.get("tool_call_id")
    if call_id is None:
        match = len(run)
        if match >= len(calls):
            raise ValueError(f"messages[{position}]: more tool results than the {len(calls)} tool calls "
                             "of the preceding assistant message")
    else:
        match = next((i for i, (id_, name) in enumerate(calls) if call_id in (id_, f"{name}:{i}")), None)
        if match is None:
            raise ValueError(f"messages[{position}].tool_call_id: {call_id!r} matches no tool call of "
                             "the preceding assistant message")
    if any(answered == match for answered, _, _ in run):
        raise ValueError(f"messages[{position}]: tool call {match} of the preceding assistant message "
                         "already has a result")
    return match


def _assistant_body(message: dict, thinking: bool, field: str) -> list[Piece]:
    pieces = []
    if thinking:
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        if not isinstance(reasoning, str):
            raise ValueError(f"{field}.reasoning_content: must be a string")
        pieces += _element("think", [], [Piece(reasoning)] if reasoning.strip() else [])
    pieces += _element("response", [], _content_pieces(message.get("content"), f"{field}.content"))
    calls = message.get("tool_calls") or []
    if calls:
        rendered_calls = []
        for index, call in enumerate(calls, start=1):
            function = _call_function(call, f"{field}.tool_calls[{index - 1}]")
            rendered_calls += _element("call", [("tool", function["name"]), ("index", index)],
                                       _arguments(function.get("arguments"),
                                                  f"{field}.tool_calls[{index - 1}].function.arguments"))
        pieces += _element("tools", [], rendered_calls)
    return pieces


def _call_function(call: Any, field: str) -> dict:
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{field}.function.name: a tool call needs a function name")
    return function


def _arguments(arguments: Any, field: str) -> list[Piece]:
    """One `argument` element per key: strings raw, every other value as JSON. Arguments
    that are not JSON at all (a model's own broken call, sent back) go verbatim in a `json` element."""
    if isinstance(arguments, str):
        if not arguments.strip():
            arguments = {}
        else:
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return _element("json", [("type", "object")], [Piece(arguments)])
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError(f"{field}: must be a JSON object")
    pieces = []
    for key, value in arguments.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        pieces += _element("argument", [("key", key), ("type", _json_type(value))], [Piece(text)] if text else [])
    return pieces


def _json_type(value: Any) -> str:
    if isinstance(value, bool):  # before int: a bool is an int in Python
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _content_pieces(content: Any, field: str) -> list[Piece]:
    """Message content: a string, or OpenAI content parts (text, and images as one placeholder each)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [Piece(content)] if content else []
    if not isinstance(content, list):
        raise ValueError(f"{field}: must be a string or a list of content parts")
    pieces = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            pieces += [Piece(part["text"])] if part["text"] else []
        elif kind in ("image_url", "image", "image_pil"):  # serve/multimodal.py reads their images
            pieces.append(Piece(IMAGE_PLACEHOLDER, True))
        else:
            raise ValueError(f"{field}[{i}].type: expected a text part (with a string `text`) or an image part")
    return pieces


def _tool_json(tools: Any, field: str) -> str:
    """Tool definitions as compact JSON with keys sorted at every depth, so the same tools in another
    key order give the same prompt (and the same prefix-cache pages)."""
    if not isinstance(tools, list):
        raise ValueError(f"{field}: must be a list of tool definitions")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{field}[{i}].function.name: a tool definition needs a function name")
    return json.dumps(_sorted_keys(tools), ensure_ascii=False, separators=(",", ":"))


def _response_format_note(response_format: Any) -> list[Piece]:
    """The `response-format` system message of a JSON response format; the schema is compact JSON
    with keys sorted, like tool definitions."""
    if response_format is None:
        return []
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return []
    if kind == "json_object":
        return _system_note("response-format", RESPONSE_FORMAT.format(kind))
    if kind != "json_schema":
        raise ValueError(f"response_format.type: {kind!r} is not one of text, json_object, json_schema")
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict):
        raise ValueError("response_format.json_schema: a json_schema response format needs a json_schema object")
    schema = json_schema.get("schema")  # optional in OpenAI's API: without it only the JSON rule is stated
    if schema is not None and not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
    text = RESPONSE_FORMAT.format(kind)
    if schema is not None:
        text += RESPONSE_SCHEMA.format(json.dumps(_sorted_keys(schema), ensure_ascii=False, separators=(",", ":")))
    return _system_note("response-format", text)


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value


def _system_note(kind: str, text: str) -> list[Piece]:
    return _element("message", [("role", "system"), ("type", kind)], [Piece(text)]) + [Piece(END_OF_MESSAGE, True)]


def _element(name: str, attrs: list[tuple[str, Any]], body: list[Piece]) -> list[Piece]:
    return _open_tag(name, attrs) + body + [Piece(CLOSE, True), Piece(name), Piece(SEP, True)]


def _open_tag(name: str, attrs: list[tuple[str, Any]] = ()) -> list[Piece]:
    return [Piece(OPEN, True), Piece(name), *(segment for key, value in attrs for segment in _attribute(key, value)),
            Piece(SEP, True)]


def _attribute(key: str, value: Any) -> list[Piece]:
    """Four segments, as the checkpoint's encoder tokenizes an attribute: with a real vocabulary,
    ` key="v"` tokenized whole can merge across them (`="` with a value's leading punctuation, say)
    and give other ids than the model was trained on."""
    escaped = str(value).replace("&", "&amp;").replace('"', "&quot;")  # `&` first, or `&quot;` is escaped twice
    return [Piece(f" {key}"), Piece('="'), *([Piece(escaped)] if escaped else []), Piece('"')]
