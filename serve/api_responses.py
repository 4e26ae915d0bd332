"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed), `GET` and `DELETE
/v1/responses/{id}`, and `POST /v1/responses/{id}/cancel`.

A request becomes a chat completion request (serve/api_chat_bridge.py) and runs as one. Its
`instructions` are a system message; `input` is a string (one user message) or items: messages
(roles user, system, developer, assistant; `input_text` / `output_text` parts, and in the other
roles' messages `input_image` parts: chat's `image_url` parts, so the chat endpoint's rules hold,
data: URLs, file:// ones under --allowed-local-media-path, --limit-mm-per-prompt, a vision tower
needed, every bad image a 400 naming `input[i].content[j]`), `reasoning`
(its `reasoning_text` content, else its summary, is the next assistant turn's reasoning),
`function_call` and `function_call_output` (answering its call by `call_id`). Consecutive
reasoning, assistant message and function call items are one assistant turn, in that order.
`reasoning.effort` is chat's `reasoning_effort` (none: K3's instant mode; low, high, max); without
it K3 thinks at its default effort. The sampling fields are chat's, vLLM's extensions included.

The output items: a `reasoning` item (its text as `reasoning_text` content; K3 writes no summary),
a `message` with one `output_text` part, a `function_call` per call. A stream sends OpenAI's
events: response.created, response.in_progress, per item response.output_item.added, its
content_part.added and text deltas (response.reasoning_text.delta, response.output_text.delta) or
its arguments (response.function_call_arguments.delta / .done), the .done events and
response.output_item.done, then response.completed (response.incomplete when max_output_tokens
cut it). `usage.output_tokens_details.reasoning_tokens` counts the reasoning text re-tokenized.

With `include: ["message.output_text.logprobs"]` the output_text carries the logprobs of its
tokens (the response channel's text tokens, serve/api_chat_bridge.py `ContentTokens`) with
`top_logprobs` alternatives each, in OpenAI's shape (token, logprob, bytes, top_logprobs); a stream's
output_text deltas carry those of the tokens that arrived since the previous delta.

`previous_response_id` continues a stored response (`store`, the default): its conversation and
output come before this request's input, as OpenAI does, and its instructions do not. Responses are
stored in this process only (serve/api_responses_store.py); GET returns one, DELETE forgets it.
`background: true` (with `store`, else a 400 as vLLM's) answers at once with the queued response,
which GET follows to its result and cancel stops; with `stream` too, the stream's events are kept
for GET ?stream=true (serve/api_responses_store.py).

Recognised but not servable, hence a 400 naming the field: file parts, file ids and `detail: "low"`
of images (an image is read at full detail), encrypted reasoning, item references, non-function
tools, reasoning summaries, a `text.format` other than text (no constrained decoding),
`parallel_tool_calls: false`, `truncation: "auto"`, `include` items other than the output_text
logprobs, `top_logprobs` without them, vLLM's `prompt_logprobs`, `conversation`, `prompt`,
`max_tool_calls`.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from serve.api_chat_bridge import (ChatRun, ContentTokens, chat_prompt, request_schema, run_chat, stream_blocks,
                                   stream_error_message, test_hook_fields, whole_output)
from serve import api_checks
from serve.api_checks import FieldError
from serve.api_outputs import Totals, token_logprobs
from serve.api_protocol import SamplingRequest, Strict
from serve.api_common import APIError, ServerConfig, check_model, unless_disconnected
from serve.api_responses_store import ResponseStore
from serve.async_engine import AsyncEngine
from serve.chat import parse_output
from serve.engine import RequestOutput
from serve.multimodal import IMAGE_DETAILS
from serve.sampling import MAX_LOGPROBS

OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` item served
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "reasoning_text", "summary_text")
# An assistant turn's parts in the order K3 writes them; an item that cannot follow the turn's last
# part starts a new turn.
TURN_ORDER = {"reasoning": 0, "message": 1, "function_call": 2}


class FunctionTool(Strict):
    type: Literal["function"]  # OpenAI's hosted tools (web_search, file_search, ...) are refused
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class Reasoning(Strict):
    effort: Literal["none", "low", "high", "max"] | None = None
    summary: str | None = None


class ResponsesRequest(SamplingRequest):
    n: Literal[1] = 1  # one output per response
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)  # None: up to the context limit
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None  # returned with the response
    text: dict[str, Any] | None = None  # only {"format": {"type": "text"}}
    include: list[str] | None = None  # only OUTPUT_LOGPROBS
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per output_text token
    background: bool = False
    # Recognised, not served: refused unless neutral.
    parallel_tool_calls: bool = True
    truncation: Literal["auto", "disabled"] = "disabled"
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    UNSUPPORTED: ClassVar[tuple] = (("prompt_logprobs", None), ("parallel_tool_calls", True),
                                    ("truncation", "disabled"), ("conversation", None), ("prompt", None),
                                    ("max_tool_calls", None))

    @property
    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for i, item in enumerate(self.include or ()):
            if item != OUTPUT_LOGPROBS:
                raise ValueError(f"include[{i}]: {item!r} is not supported by this server (only {OUTPUT_LOGPROBS!r}; "
                                 "reasoning is returned as text, unencrypted)")
        if self.top_logprobs and not self.wants_logprobs:
            raise ValueError(f"top_logprobs: needs include [{OUTPUT_LOGPROBS!r}]")
        if self.reasoning is not None and self.reasoning.summary is not None:
            raise ValueError("reasoning.summary: not supported by this server (K3 writes no summary; the "
                             "reasoning itself is returned)")
        if self.text not in (None, {}, {"format": {"type": "text"}}):
            raise ValueError('text: only {"format": {"type": "text"}} is supported by this server')
        if self.background and not self.store:
            raise ValueError("background: can only be used when `store` is true")

    def chat_fields(self, previous: list[dict]) -> tuple[dict, list[str]]:
        """The chat request's fields and, per chat message, the part of this request it came from,
        for a conversation that continues the `previous` items."""
        self.check_unsupported()
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        paths = ["previous_response_id"] * len(previous) + \
            (["input"] if isinstance(self.input, str) else [f"input[{i}]" for i in range(len(items))])
        messages, sources = _messages(previous + items, paths)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
            sources.insert(0, "instructions")
        fields = self.model_dump(include=set(SamplingRequest.model_fields) - {"n", "stream_options"})
        fields.update(messages=messages, max_tokens=self.max_output_tokens, **test_hook_fields(self))
        if self.tools:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                               for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["reasoning_effort"] = self.reasoning.effort
        if self.wants_logprobs:
            fields.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        return fields, sources


def _messages(items: list, paths: list[str]) -> tuple[list[dict], list[str]]:
    """Input items as chat messages, each with the path of the item it starts from."""
    messages, sources = [], []
    turn = None  # the assistant message being built, and the order of its last part
    for item, path in zip(items, paths):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind in TURN_ORDER and (kind != "message" or item.get("role") == "assistant"):
            order = TURN_ORDER[kind]
            if turn is None or order < turn[1] or (order == turn[1] and kind != "function_call"):
                turn = [{"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}, order]
                messages.append(turn[0])
                sources.append(path)
            turn[1] = order
            _add_to_turn(turn[0], kind, item, path)
            continue
        turn = None
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise FieldError(f"{path}.role", f"{path}.role: {role!r} is not one of {', '.join(ROLES)}")
            messages.append({"role": role, "content": _content(item.get("content"), f"{path}.content")})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", path),
                             "content": _text(item.get("output"), f"{path}.output")})
        else:
            raise FieldError(f"{path}.type", f"{path}.type: {kind!r} is not one of message, reasoning, "
                                             "function_call, function_call_output")
        sources.append(path)
    return messages, sources


def _add_to_turn(message: dict, kind: str, item: dict, path: str) -> None:
    if kind == "reasoning":
        if item.get("encrypted_content") is not None:
            raise FieldError(f"{path}.encrypted_content", f"{path}.encrypted_content: encrypted reasoning is "
                                                          "not supported by this server")
        parts = item.get("content") or item.get("summary") or []
        message["reasoning_content"] += _text(parts, f"{path}.content")
    elif kind == "message":
        message["content"] += _text(item.get("content"), f"{path}.content")
    else:
        message["tool_calls"].append({"id": _string(item, "call_id", path), "type": "function",
                                      "function": {"name": _string(item, "name", path),
                                                   "arguments": _string(item, "arguments", path)}})


def _string(item: dict, key: str, path: str) -> str:
    if not isinstance(item.get(key), str):
        raise FieldError(f"{path}.{key}", f"{path}.{key}: must be a string")
    return item[key]


def _text(content: Any, field: str) -> str:
    """The text of a string or of text parts (input_text, output_text, reasoning_text, summary_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(field, f"{field}: must be a string or a list of content parts")
    return "".join(_part_text(part, f"{field}[{j}]") for j, part in enumerate(content))


def _part_text(part: Any, field: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    why = {"input_image": " (images are input: user, system and developer messages hold them)",
           "input_file": " (file inputs are not supported by this server)"}.get(kind, "")
    raise FieldError(f"{field}.type", f"{field}.type: {kind!r} is not a text part{why}")


def _content(content: Any, field: str) -> str | list[dict]:
    """A user, system or developer message's content: its text, or chat's content parts when it holds
    an image, one per part (so the chat endpoint's errors about part j name this message's part j)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, field)
    return [_image_part(part, f"{field}[{j}]") if isinstance(part, dict) and part.get("type") == "input_image" else
            {"type": "text", "text": _part_text(part, f"{field}[{j}]")} for j, part in enumerate(content)]


def _image_part(part: dict, field: str) -> dict:
    """An input_image part as chat's image_url part, which the chat endpoint's rules read."""
    if part.get("file_id") is not None:
        raise FieldError(f"{field}.file_id", f"{field}.file_id: file ids are not supported by this server (it has "
                                             "no Files API); send the image as image_url")
    if not isinstance(part.get("image_url"), str):
        raise FieldError(f"{field}.image_url", f"{field}.image_url: must be a data: URL (or a file:// URL under "
                                               "the server's --allowed-local-media-path)")
    if part.get("detail", "auto") not in IMAGE_DETAILS:
        raise FieldError(f"{field}.detail", f"{field}.detail: {part['detail']!r} is not supported by this server "
                                            f"(one of {', '.join(IMAGE_DETAILS)}: images are read at full detail)")
    return {"type": "image_url", "image_url": {"url": part["image_url"]}}


def add_responses_routes(app: FastAPI, engine: AsyncEngine, config: ServerConfig) -> None:
    stored = ResponseStore()

    async def create(body: ResponsesRequest, request: Request):
        check_model(body.model, config)
        previous = [] if body.previous_response_id is None else stored.conversation(body.previous_response_id)
        try:
            fields, sources = body.chat_fields(previous)
        except ValueError as error:
            error = api_checks.field_error(error)
            raise APIError(400, str(error), param=error.param) from error
        prompt = await chat_prompt(fields, sources, {"max_tokens": "max_output_tokens"}, engine, config, images=True)
        run = await run_chat(prompt, engine, "input")
        response = _Response(body, engine, config)
        inputs = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input

        def store(final: dict) -> None:
            if body.background:
                stored.finish(final["id"], previous + inputs + final["output"], final)
            elif body.store and final["status"] != "failed":
                stored.put(final["id"], previous + inputs + final["output"], final)

        if body.background:
            run = dataclasses.replace(run, outputs=_on_first(run.outputs, lambda: stored.started(response.id)))
            work = response.stream(run, store) if body.stream else response.whole(run, store)
            stored.run_in_background(response.id, response.envelope("queued", [], None), work, run.group.abort)
            if body.stream:
                return StreamingResponse(stored.events(response.id, None), media_type="text/event-stream")
            return stored.get(response.id)
        if body.stream:
            return StreamingResponse(response.stream(run, store), media_type="text/event-stream")
        return await unless_disconnected(request, response.whole(run, store))

    create.__annotations__["body"] = request_schema(ResponsesRequest, config)
    app.post("/v1/responses")(create)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, stream: bool = False, starting_after: int | None = None):
        if stream:
            return StreamingResponse(stored.events(response_id, starting_after), media_type="text/event-stream")
        return stored.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        stored.forget(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str):
        return await stored.cancel(response_id)


async def _on_first(outputs, started):
    """`outputs`, calling `started` when the first arrives."""
    first = True
    async for output in outputs:
        if first:
            started()
            first = False
        yield output


class _Response:
    """One response: its envelope, output items and usage."""

    def __init__(self, body: ResponsesRequest, engine: AsyncEngine, config: ServerConfig):
        self.body = body
        self.tokenizer = engine.tokenizer
        self.id = f"resp_{secrets.token_hex(24)}"
        self.created_at = int(time.time())
        self.model = config.model_name
        self.sequence_number = 0
        self.top_logprobs = (body.top_logprobs or 0) if body.wants_logprobs else None  # None: no logprobs

    def envelope(self, status: str, output: list, usage: dict | None) -> dict:
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "metadata": body.metadata or {}, "parallel_tool_calls": True,
                "previous_response_id": body.previous_response_id,
                "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
                "store": body.store, "background": body.background, "temperature": body.temperature,
                "top_p": body.top_p,
                "text": {"format": {"type": "text"}}, "tool_choice": _dumped(body.tool_choice) or "auto",
                "tools": [tool.model_dump() for tool in body.tools or ()], "top_logprobs": body.top_logprobs,
                "truncation": "disabled", "usage": usage}

    def content_tokens(self, run: ChatRun) -> ContentTokens | None:
        """The reader of the content's tokens when logprobs were asked for, else None."""
        return None if self.top_logprobs is None else ContentTokens(self.tokenizer, run.prompt.thinking)

    def logprobs(self, content: ContentTokens | None, output: RequestOutput) -> list[dict]:
        """The output_text logprobs of the content tokens among `output`'s (a whole output or a delta)."""
        if content is None:
            return []
        entries = output.logprobs or []  # none when the test hook forced the output
        positions = [i for i in content.positions(output.token_ids) if i < len(entries)]
        return token_logprobs(self.tokenizer, [output.token_ids[i] for i in positions],
                              [entries[i] for i in positions], self.top_logprobs)

    def final(self, output_items: list, output: RequestOutput) -> dict:
        reasoning = "".join(item["content"][0]["text"] for item in output_items if item["type"] == "reasoning")
        completion = len(output.token_ids)
        usage = {"input_tokens": len(output.prompt_token_ids), "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
                 "output_tokens": completion,
                 "output_tokens_details": {"reasoning_tokens": min(completion, len(self.tokenizer.encode(reasoning)))},
                 "total_tokens": len(output.prompt_token_ids) + completion}
        status = "incomplete" if output.finish_reason == "length" else "completed"
        return self.envelope(status, output_items, usage)

    async def whole(self, run: ChatRun, store) -> dict:
        output = await whole_output(run)
        parsed = parse_output(output.text or "", thinking=run.prompt.thinking, tools=run.prompt.tools)
        items = [_reasoning_item(parsed.reasoning_content)] if parsed.reasoning_content else []
        items += [_message_item(parsed.content, self.logprobs(self.content_tokens(run), output))] \
            if parsed.content else []
        items += [_call_item(call) for call in parsed.tool_calls]
        final = self.final(items, output)
        store(final)
        return final

    def event(self, kind: str, **data) -> str:
        self.sequence_number += 1
        data = {"type": kind, "sequence_number": self.sequence_number - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def stream(self, run: ChatRun, store):
        """OpenAI's events; each block of the output is an output item."""
        yield self.event("response.created", response=self.envelope("in_progress", [], None))
        yield self.event("response.in_progress", response=self.envelope("in_progress", [], None))
        totals, items, text = Totals(1), [], ""
        content = self.content_tokens(run)
        pending, sent = [], []  # the content's logprobs not yet sent with a delta; those sent in this item

        def on_output(output: RequestOutput) -> None:
            pending.extend(self.logprobs(content, output))

        def delta_logprobs() -> list[dict]:
            taken = pending.copy()
            pending.clear()
            sent.extend(taken)
            return taken

        try:
            async for block in stream_blocks(run, totals, on_output):
                where = {"output_index": len(items) - 1}
                if block[0] == "open":
                    item = _ITEMS[block[1]]("")
                    items.append(item)
                    where = {"item_id": item["id"], "output_index": len(items) - 1}
                    part = item["content"].pop()  # the item's content grows by its part when the part is done
                    yield self.event("response.output_item.added", output_index=len(items) - 1,
                                     item={**item, "status": "in_progress"})
                    yield self.event("response.content_part.added", **where, content_index=0, part=part)
                elif block[0] == "text":
                    text += block[2]
                    delta = {"delta": block[2]} if block[1] == "reasoning" else \
                        {"delta": block[2], "logprobs": delta_logprobs()}
                    yield self.event(f"response.{_TEXT_EVENTS[block[1]]}.delta", item_id=items[-1]["id"], **where,
                                     content_index=0, **delta)
                elif block[0] == "close":
                    item, where = items[-1], {"item_id": items[-1]["id"], **where}
                    extra = {}
                    if block[1] == "text":
                        if pending:  # tokens whose text the parser dropped: their logprobs still come
                            yield self.event("response.output_text.delta", **where, content_index=0, delta="",
                                             logprobs=delta_logprobs())
                        extra = {"logprobs": sent.copy()}
                        sent.clear()
                    part = _part(block[1], text, **extra)
                    item["content"].append(part)
                    yield self.event(f"response.{_TEXT_EVENTS[block[1]]}.done", **where, content_index=0, text=text,
                                     **extra)
                    yield self.event("response.content_part.done", **where, content_index=0, part=part)
                    yield self.event("response.output_item.done", output_index=len(items) - 1, item=item)
                    text = ""
                else:
                    item = _call_item(block[1])
                    items.append(item)
                    where = {"item_id": item["id"], "output_index": len(items) - 1}
                    yield self.event("response.output_item.added", output_index=len(items) - 1,
                                     item={**item, "arguments": "", "status": "in_progress"})
                    yield self.event("response.function_call_arguments.delta", **where, delta=item["arguments"])
                    yield self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=item["arguments"])
                    yield self.event("response.output_item.done", output_index=len(items) - 1, item=item)
            final = self.final(items, totals.outputs[0])
            store(final)
            yield self.event(f"response.{final['status']}", response=final)
        except Exception as error:  # headers are sent: the error goes in the stream
            message = stream_error_message(error, self.id)
            store({**self.envelope("failed", items, None), "error": {"code": "server_error", "message": message}})
            yield self.event("error", code="server_error", message=message, param=None)


_TEXT_EVENTS = {"reasoning": "reasoning_text", "text": "output_text"}


def _dumped(value):
    return value.model_dump() if hasattr(value, "model_dump") else value


def _part(kind: str, text: str, logprobs: list | None = None) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _reasoning_item(text: str) -> dict:
    return {"id": f"rs_{secrets.token_hex(24)}", "type": "reasoning", "summary": [],
            "content": [_part("reasoning", text)], "status": "completed"}


def _message_item(text: str, logprobs: list | None = None) -> dict:
    return {"id": f"msg_{secrets.token_hex(24)}", "type": "message", "role": "assistant", "status": "completed",
            "content": [_part("text", text, logprobs)]}


_ITEMS = {"reasoning": _reasoning_item, "text": _message_item}


def _call_item(call: dict) -> dict:
    return {"id": f"fc_{secrets.token_hex(24)}", "type": "function_call", "call_id": f"call_{secrets.token_hex(12)}",
            "name": call["name"], "arguments": call["arguments"], "status": "completed"}
