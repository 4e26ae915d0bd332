"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and `/v1/messages/count_tokens`.

A request becomes a chat completion request (serve/api_chat_bridge.py) and runs as one:

* `system` (a string or text blocks) is a system message; text blocks are text parts; `tool_use`
  blocks are an assistant message's tool calls (arguments: `input` as JSON), `tool_result` blocks
  tool messages answering them by `tool_use_id`, and `thinking` blocks its reasoning. A failed
  tool's result (`is_error`) reaches the model as its text after "Error: ", since K3's tool
  message has no error flag. `cache_control` is a hint that the prefix cache serves by itself.
* `thinking`: absent or `{"type": "disabled"}` is K3's instant mode (Claude does not think unless
  asked); `{"type": "enabled", "budget_tokens": N}` is thinking mode, with K3's effort by budget:
  under 4096 tokens `low`, under 16384 `high`, else `max` (K3 has no budget; the effort is what the
  model was trained to scale its thinking by). As Anthropic's API, the budget is at least 1024 and
  below max_tokens. `{"type": "adaptive"}` thinks at K3's default effort. `output_config.effort`
  (low, high, max: K3's efforts) sets the effort of either.
* tools are custom tools (`input_schema` is the function's parameters); `tool_choice` auto, any
  (a call is required), tool (that tool, required) and none.
* The answer's blocks: `thinking` (with an empty signature: K3's reasoning is not signed), `text`,
  `tool_use` (ids `toolu_...`); stop_reason `tool_use`, `max_tokens`, `stop_sequence` (with the
  matched `stop_sequence`) or `end_turn`. A stream sends Anthropic's events in their order:
  message_start, per block content_block_start / _delta / _stop, message_delta, message_stop.

* `image` blocks in user messages (a `base64` source; a model with a vision tower) are the chat
  request's image parts, each expanded into its pads after the prompt is rendered (serve/multimodal.py);
  an image the chat endpoint would refuse is a 400 naming the block. A `url` source is refused: the
  server fetches nothing remote.

Recognised but not servable, hence a 400 naming the field: document and other non-text blocks,
images outside user messages, `redacted_thinking`, server tools, `disable_parallel_tool_use`,
`container`, `mcp_servers`, `context_management`, `output_config.format`, thinking `display:
"omitted"`, an effort K3 lacks (medium, xhigh). Errors on these routes have Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, with the status the app's handlers give.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import Field

from serve.api_chat_bridge import (ChatRun, chat_prompt, matched_stop, request_schema, run_chat, stream_blocks,
                                   stream_error_message, test_hook_fields, whole_output)
from serve.api_checks import FieldError, field_error
from serve.api_outputs import Totals
from serve.api_protocol import Strict
from serve.api_common import APIError, ServerConfig, check_model, unless_disconnected
from serve.async_engine import AsyncEngine
from serve.chat import parse_output
from serve.engine import RequestOutput
from serve.multimodal import expand_images, image_bytes, load_image

# budget_tokens -> K3's thinking effort: the first effort whose bound the budget is under.
EFFORT_BUDGETS = ((4096, "low"), (16384, "high"))
MAX_EFFORT = "max"
MIN_THINKING_BUDGET = 1024  # Anthropic's minimum
# Anthropic's error types by HTTP status; any other status is an "api_error".
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    budget_tokens: int  # at least MIN_THINKING_BUDGET: checked with the request, to name the field as sent
    display: Literal["summarized"] | None = None  # "omitted" (thinking redacted, signed) is not served


class ThinkingAdaptive(Strict):
    type: Literal["adaptive"]
    display: Literal["summarized"] | None = None


class ThinkingDisabled(Strict):
    type: Literal["disabled"]


class OutputConfig(Strict):
    effort: Literal["low", "high", "max"] | None = None  # K3's efforts: no medium, no xhigh
    format: Any = None  # structured output: refused, there is no constrained decoding


class CustomTool(Strict):
    type: Literal["custom"] | None = None  # a server tool's type (web_search_..., bash_...) is refused
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(Strict):
    """What `/v1/messages/count_tokens` takes: the fields that make the prompt."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    thinking: ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled | None = Field(None, discriminator="type")
    output_config: OutputConfig | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    # Anthropic's, not served here: refused when set.
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    UNSUPPORTED: ClassVar[tuple] = ("container", "mcp_servers", "context_management")

    def chat_fields(self) -> tuple[dict, list[str]]:
        """The chat request's fields (without the sampling ones) and, per chat message, the part
        of this request it came from."""
        for field in self.UNSUPPORTED:
            if getattr(self, field) is not None:
                raise FieldError(field, f"{field}: not supported by this server")
        messages, sources = [], []
        if self.system is not None:
            messages.append({"role": "system", "content": _text_of(self.system, "system")})
            sources.append("system")
        for i, message in enumerate(self.messages):
            converted = (_user_messages if message.role == "user" else _assistant_messages)(message, f"messages[{i}]")
            messages += [m for m, _ in converted]
            sources += [s for _, s in converted]
        fields = {"model": self.model, "messages": messages, **self._tool_fields()}
        effort = self._effort()
        return fields | ({"reasoning_effort": effort} if effort is not None else {}), sources

    def _effort(self) -> str | None:
        """Chat's reasoning_effort: "none" (instant mode), an effort, or None (thinking at K3's default)."""
        config = self.output_config or OutputConfig()
        if config.format is not None:
            raise FieldError("output_config.format", "output_config.format: not supported by this server (no "
                                                     "constrained decoding)")
        if not isinstance(self.thinking, ThinkingEnabled | ThinkingAdaptive):
            if config.effort is not None:
                raise FieldError("output_config.effort", "output_config.effort: K3's effort is its thinking's: "
                                                         "needs thinking enabled or adaptive")
            return "none"
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens < MIN_THINKING_BUDGET:
            raise FieldError("thinking.budget_tokens", f"thinking.budget_tokens: at least {MIN_THINKING_BUDGET}")
        if config.effort is not None or isinstance(self.thinking, ThinkingAdaptive):
            return config.effort
        return next((effort for bound, effort in EFFORT_BUDGETS if self.thinking.budget_tokens < bound), MAX_EFFORT)

    def _tool_fields(self) -> dict:
        tools = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                   "parameters": tool.input_schema}} for tool in self.tools or ()]
        choice = self.tool_choice
        if choice is None:
            return {"tools": tools or None}
        if choice.disable_parallel_tool_use:
            raise FieldError("tool_choice.disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use: "
                             "not supported by this server (the number of calls cannot be constrained)")
        if (choice.type == "tool") != (choice.name is not None):
            raise FieldError("tool_choice.name", "tool_choice.name: required with type 'tool', and only then")
        if choice.type in ("any", "tool") and not tools:
            raise FieldError("tool_choice", f"tool_choice: type {choice.type!r} needs tools")
        named = {"type": "function", "function": {"name": choice.name}}
        return {"tools": tools or None,
                "tool_choice": named if choice.type == "tool" else {"any": "required"}.get(choice.type, choice.type)}


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: no top-k
    metadata: dict[str, Any] | None = None  # user_id, for the caller's own tracking: nothing to serve

    def chat_fields(self) -> tuple[dict, list[str]]:
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise FieldError("thinking.budget_tokens", "thinking.budget_tokens: must be less than max_tokens")
        fields, sources = super().chat_fields()
        fields.update(max_tokens=self.max_tokens, stop=self.stop_sequences, temperature=self.temperature,
                      top_p=self.top_p, top_k=self.top_k, **test_hook_fields(self))
        return fields, sources


def _text_of(content: str | list, field: str) -> str:
    """The text of a string or of text blocks (Anthropic's system prompt, a tool result)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise FieldError(f"{field}[{j}]", f"{field}[{j}]: only text blocks (with a string `text`) are "
                                              "supported here")
        texts.append(block["text"])
    return "".join(texts)


def _blocks(content: str | list, field: str) -> list[tuple[str, dict]]:
    """(path, block) of a message's content blocks, each checked to be a dict with a type."""
    if isinstance(content, str):
        return [(f"{field}.content", {"type": "text", "text": content})]
    blocks = []
    for j, block in enumerate(content):
        path = f"{field}.content[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise FieldError(path, f"{path}: a content block is an object with a `type`")
        if block["type"] == "document":
            raise FieldError(f"{path}.type", f"{path}.type: document blocks are not supported by this server")
        blocks.append((path, block))
    return blocks


def _user_messages(message: Message, field: str) -> list[tuple[dict, str]]:
    """A user message as chat messages with their sources: each tool result its own tool message
    (K3 renders them after the calls they answer), the text blocks between them user messages."""
    converted, parts = [], []
    for path, block in _blocks(message.content, field):
        if block["type"] == "text":
            parts.append({"type": "text", "text": _text_of([block], path)})
            continue
        if block["type"] == "image":  # its pads come in once the prompt is rendered (_with_images)
            parts.append({"type": "image", "source": block.get("source"), "block": path})
            continue
        if block["type"] != "tool_result":
            raise FieldError(f"{path}.type", f"{path}.type: {block['type']!r} is not one of text, image, "
                                              "tool_result")
        if parts:
            converted.append(({"role": "user", "content": _user_content(parts)}, field))
            parts = []
        if not isinstance(block.get("tool_use_id"), str):
            raise FieldError(f"{path}.tool_use_id", f"{path}.tool_use_id: a tool result needs a tool_use_id")
        result = _text_of(block.get("content") or "", f"{path}.content")
        is_error = block.get("is_error", False)
        if not isinstance(is_error, bool):
            raise FieldError(f"{path}.is_error", f"{path}.is_error: must be true or false")
        converted.append(({"role": "tool", "tool_call_id": block["tool_use_id"],
                           "content": f"Error: {result}" if is_error else result}, path))
    if parts or not converted:
        converted.append(({"role": "user", "content": _user_content(parts)}, field))
    return converted


def _user_content(parts: list[dict]):
    """A user message's content: its text as one string, or its parts when it holds an image."""
    if any(part["type"] == "image" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _assistant_messages(message: Message, field: str) -> list[tuple[dict, str]]:
    reasoning, texts, calls = [], [], []
    for path, block in _blocks(message.content, field):
        kind = block["type"]
        if kind == "text":
            texts.append(_text_of([block], path))
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str) \
                and isinstance(block.get("input"), dict):
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        else:
            raise FieldError(path, f"{path}: expected a text, thinking (with `thinking`) or tool_use (with `id`, "
                                   "`name`, `input`) block")
    return [({"role": "assistant", "content": "".join(texts), "reasoning_content": "".join(reasoning),
              "tool_calls": calls or None}, field)]


def add_messages_routes(app: FastAPI, engine: AsyncEngine, config: ServerConfig) -> None:
    router = APIRouter(route_class=_AnthropicErrors)

    async def messages(body: MessagesRequest, request: Request):
        check_model(body.model, config)
        run = await run_chat(await _prompt(body, engine, config), engine, "messages")
        response_id = f"msg_{secrets.token_hex(12)}"
        if body.stream:
            return StreamingResponse(_stream(run, response_id, body, engine, config), media_type="text/event-stream")
        return await unless_disconnected(request, _whole(run, response_id, body, engine, config))

    messages.__annotations__["body"] = request_schema(MessagesRequest, config)
    router.post("/v1/messages")(messages)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        check_model(body.model, config)
        return {"input_tokens": len((await _prompt(body, engine, config)).ids)}

    app.include_router(router)


async def _prompt(body: CountTokensRequest, engine: AsyncEngine, config: ServerConfig):
    try:
        fields, sources = body.chat_fields()
    except FieldError as error:
        raise APIError(400, str(error), param=error.param) from error
    prompt = await chat_prompt(fields, sources, {"stop": "stop_sequences"}, engine, config)
    images = [part for m in fields["messages"] if isinstance(m["content"], list) for part in m["content"]
              if part["type"] == "image"]
    if images:
        try:
            prompt.ids = await asyncio.to_thread(_with_images, prompt.ids, images, engine, config)
        except ValueError as error:
            error = field_error(error)
            raise APIError(400, str(error), param=error.param) from error
    return prompt


def _with_images(ids: list[int], images: list[dict], engine: AsyncEngine, config: ServerConfig):
    """The rendered prompt (one placeholder per image block) with its images, as the chat endpoint's
    (serve/multimodal.chat_images); errors name the image block."""
    vision, inputs = engine.engine.model.vision, []
    for part in images:
        path, source = part["block"], part["source"]
        if len(inputs) == config.limit_mm_per_prompt:  # first: a limit of 0 drops the tower (k3jax.serve)
            raise FieldError(path, f"{path}: at most {config.limit_mm_per_prompt} images per prompt on this server "
                                   "(--limit-mm-per-prompt)")
        if vision is None:
            raise FieldError(path, f"{path}: this model has no vision tower; it takes no images")
        if not isinstance(source, dict) or source.get("type") != "base64" or not isinstance(source.get("data"), str):
            raise FieldError(f"{path}.source", f"{path}.source: only base64 image sources are served (this server "
                                               "fetches nothing remote)")
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
        inputs.append(load_image(image_bytes(url, field=path), vision.processor, field=path))
    return expand_images(ids, inputs, engine.tokenizer)


def _stop(output: RequestOutput, called_tools: bool, body: MessagesRequest, engine: AsyncEngine) -> dict:
    sequence = matched_stop(output, tuple(body.stop_sequences or ()), engine.tokenizer)
    reason = "tool_use" if called_tools else "max_tokens" if output.finish_reason == "length" else \
        "stop_sequence" if sequence is not None else "end_turn"
    return {"stop_reason": reason, "stop_sequence": sequence}


def _tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": call["name"],
            "input": json.loads(call["arguments"])}


def _message(response_id: str, config: ServerConfig, content: list, usage: dict, stop: dict) -> dict:
    return {"id": response_id, "type": "message", "role": "assistant", "model": config.model_name,
            "content": content, **stop, "usage": usage}


async def _whole(run: ChatRun, response_id: str, body: MessagesRequest, engine: AsyncEngine,
                 config: ServerConfig) -> dict:
    output = await whole_output(run)
    parsed = parse_output(output.text or "", thinking=run.prompt.thinking, tools=run.prompt.tools)
    content = [{"type": "thinking", "thinking": parsed.reasoning_content, "signature": ""}] \
        if parsed.reasoning_content else []
    content += [{"type": "text", "text": parsed.content}] if parsed.content else []
    content += [_tool_use(call) for call in parsed.tool_calls]
    usage = {"input_tokens": len(run.prompt.ids), "output_tokens": len(output.token_ids)}
    return _message(response_id, config, content, usage, _stop(output, bool(parsed.tool_calls), body, engine))


async def _stream(run: ChatRun, response_id: str, body: MessagesRequest, engine: AsyncEngine, config: ServerConfig):
    """Anthropic's events; the output's blocks as content blocks, numbered in order."""
    usage = {"input_tokens": len(run.prompt.ids), "output_tokens": 0}
    yield _event("message_start", {"message": _message(response_id, config, [], usage,
                                                       {"stop_reason": None, "stop_sequence": None})})
    totals, index, called_tools = Totals(1), -1, False
    try:
        async for block in stream_blocks(run, totals):
            kind = block[0]
            if kind == "open":
                index += 1
                start = {"type": "thinking", "thinking": "", "signature": ""} if block[1] == "reasoning" else \
                    {"type": "text", "text": ""}
                yield _event("content_block_start", {"index": index, "content_block": start})
            elif kind == "text":
                delta = {"type": "thinking_delta", "thinking": block[2]} if block[1] == "reasoning" else \
                    {"type": "text_delta", "text": block[2]}
                yield _event("content_block_delta", {"index": index, "delta": delta})
            elif kind == "close":
                yield _event("content_block_stop", {"index": index})
            else:  # a whole tool call: its block opens, takes its input at once, and closes
                index += 1
                called_tools = True
                use = _tool_use(block[1])
                yield _event("content_block_start", {"index": index, "content_block": {**use, "input": {}}})
                yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                               "partial_json": block[1]["arguments"]}})
                yield _event("content_block_stop", {"index": index})
        output = totals.outputs[0]
        yield _event("message_delta", {"delta": _stop(output, called_tools, body, engine),
                                       "usage": {"output_tokens": len(output.token_ids)}})
        yield _event("message_stop", {})
    except Exception as error:  # headers are sent: the error goes in the stream
        message = stream_error_message(error, response_id)
        yield _event("error", {"error": {"type": "api_error", "message": message}})


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _AnthropicErrors(APIRoute):
    """Errors in Anthropic's shape on these routes. The app's own handlers (found by the error's
    class, as Starlette finds them) still decide the status and the message; this only reshapes the
    body, so the two APIs cannot disagree on what is an error."""

    def get_route_handler(self):
        handle = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handle(request)
            except Exception as error:
                handlers = request.app.exception_handlers
                handler = next(handlers[kind] for kind in type(error).__mro__ if kind in handlers)
                response = await handler(request, error)
                message = json.loads(response.body)["error"]["message"]
                kind = ERROR_TYPES.get(response.status_code, "api_error")
                return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                                    status_code=response.status_code, headers=_retry_after(response))

        return route


def _retry_after(response) -> dict | None:
    value = response.headers.get("retry-after")
    return None if value is None else {"Retry-After": value}
