"""What the Messages (api_anthropic.py) and Responses (api_responses.py) endpoints share.

Each turns its request into the fields of a chat completion request (serve/api_protocol.py) and
runs that the way the chat endpoint does: the same schema checks, thinking and tool switches,
sampling params, prompt encoding and test hook. Errors name the caller's fields: a converted
message's problems name the part of the request it came from (`sources`), and `names` maps chat
field names to the API's own (`stop` is Anthropic's `stop_sequences`). The output goes through the
same K3 parsers as chat's; a stream's parser deltas come out as blocks (Anthropic's content blocks,
OpenAI's output items): reasoning or text that grows until the other kind or a tool call arrives,
and each tool call whole. Chat's `image_url` parts in the converted messages are read as the chat
endpoint reads them (`chat_inputs`), which /tokenize shares.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterator

import pydantic
from pydantic import BaseModel

from serve import api_checks, multimodal
from serve.api_checks import FieldError
from serve.api_outputs import Totals
from serve.api_protocol import ChatCompletionRequest, ChatRequestWithTestHook
from serve.api_common import APIError, ServerConfig, forced_outputs, forced_tokens, submit
from serve.async_engine import AsyncEngine, RequestFailed, RequestGroup
from serve.chat import Delta, OutputParser
from serve.engine import RequestOutput
from serve.sampling import SamplingParams

logger = logging.getLogger(__name__)

TEST_HOOK = "k3jax_test_forced_output"
_MESSAGE_PATH = re.compile(r"^messages\[(\d+)\]")


def request_schema(schema: type[BaseModel], config: ServerConfig) -> type[BaseModel]:
    """TESTING ONLY when hooked: `schema` with the chat test hook's field, on a server started with
    --enable-test-hooks (elsewhere the field is unknown, hence ignored), as the chat endpoint does."""
    if not config.enable_test_hooks:
        return schema
    return pydantic.create_model(f"{schema.__name__}WithTestHook", __base__=schema, **{TEST_HOOK: (str | None, None)})


def test_hook_fields(body: BaseModel) -> dict:
    """The test hook's field of a hooked request, to pass on into its chat request."""
    forced = getattr(body, TEST_HOOK, None)
    return {} if forced is None else {TEST_HOOK: forced}


@dataclasses.dataclass
class ChatPrompt:
    """A converted request's prompt and what reading its output needs."""

    ids: list[int] | multimodal.MultimodalPrompt
    params: SamplingParams
    thinking: bool
    tools: list[dict] | None  # what tool calls are parsed against; None when they are not parsed
    forced: list[int] | None  # TESTING ONLY: the test hook's output tokens


@dataclasses.dataclass
class ChatRun:
    group: RequestGroup
    outputs: AsyncIterator  # (index, RequestOutput) deltas; the test hook's tokens when it forces them
    prompt: ChatPrompt


async def chat_prompt(fields: dict, sources: list[str], names: dict[str, str], engine: AsyncEngine,
                      config: ServerConfig, *, images: bool = False) -> ChatPrompt:
    """The prompt and sampling params of a chat request with these `fields` (its messages converted
    from the request parts that `sources` names, one each), checked as the chat endpoint checks;
    with `images`, its `image_url` parts expanded as the chat endpoint expands them (the Messages
    route expands its own image blocks)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer files, which chat needs; use /v1/completions with "
                            "token ids")
    schema = ChatRequestWithTestHook if config.enable_test_hooks else ChatCompletionRequest
    try:
        try:
            chat = schema.model_validate(fields)
        except pydantic.ValidationError as error:
            problem = error.errors()[0]
            field = api_checks.validation_param(problem["loc"])
            raise FieldError(field, f"{field}: {problem['msg']}") from None
        chat.check_unsupported()
        api_checks.check_nesting(chat)
        options = chat.prompt_options()
        thinking, tools = options["thinking"], options["tools"]
        params = chat.chat_sampling_params(0)
        forced = forced_tokens(chat, tokenizer)
        ids = await api_checks.chat_prompt_ids(tokenizer, chat.messages, engine.max_model_len, **options)
        if images:
            ids = await asyncio.to_thread(chat_inputs, ids, chat.messages, engine, config)
    except ValueError as error:
        error = _renamed(api_checks.field_error(error, names), sources)
        raise APIError(400, str(error), param=error.param) from error
    if forced is not None:
        params = dataclasses.replace(params, max_tokens=len(forced), ignore_eos=True)
    return ChatPrompt(ids, params, thinking, tools if chat.parses_tool_calls() else None, forced)


def chat_inputs(ids: list[int], messages: list, engine: AsyncEngine, config: ServerConfig):
    """A rendered chat prompt with its messages' `image_url` parts read and expanded as the chat
    endpoint does (serve/multimodal.chat_prompt, under the server's --allowed-local-media-path and
    --limit-mm-per-prompt; a model without a vision tower refuses every image). Blocks: run it in a
    worker thread. ValueErrors name the part, `messages[i].content[j]`."""
    vision = engine.engine.model.vision
    return multimodal.chat_prompt(ids, messages, engine.tokenizer, None if vision is None else vision.processor,
                                  allowed_local_media_path=config.allowed_local_media_path,
                                  limit=config.limit_mm_per_prompt)


def _renamed(error: FieldError, sources: list[str]) -> FieldError:
    """A converted message's error as an error of the request part it came from (a part within the
    message keeps its path: `messages[2].content[1]` of `input[0]` is `input[0].content[1]`)."""
    match = _MESSAGE_PATH.match(error.param or "")
    if match is None:
        return error
    source = sources[int(match.group(1))]
    message = str(error)
    return FieldError(source + error.param[match.end():],
                      source + message[match.end():] if message.startswith(match.group()) else message)


async def run_chat(prompt: ChatPrompt, engine: AsyncEngine, input_field: str) -> ChatRun:
    group = await submit(engine, [(prompt.ids, prompt.params)], rename={"prompt": input_field})
    tokenizer = engine.tokenizer
    outputs = group if prompt.forced is None else forced_outputs(group, prompt.forced, tokenizer, [prompt.params])
    return ChatRun(group, outputs, prompt)


async def whole_output(run: ChatRun) -> RequestOutput:
    """The run's whole output (its deltas joined); the engine request is aborted if the client left."""
    totals = Totals(1)
    try:
        async for index, output in run.outputs:
            totals.add(index, output)
    except RequestFailed as error:
        raise APIError(500, str(error)) from error
    finally:
        run.group.abort()
    return totals.outputs[0]


def matched_stop(output: RequestOutput, stops: tuple[str, ...], tokenizer) -> str | None:
    """The stop string that ended `output`, or None. The engine cuts the text before the stop string;
    the tokens still hold it, so what they decode to beyond the text starts with it."""
    if output.finish_reason != "stop" or not stops:
        return None
    beyond = tokenizer.decode(output.token_ids)[len(output.text or ""):]
    return next((stop for stop in stops if beyond.startswith(stop)), None)


# A stream's blocks: ("open", kind), ("text", kind, text), ("close", kind) for kind "reasoning" or
# "text"; ("call", {"name", "arguments"}) for a whole tool call (each API makes its own call ids).
Block = tuple


async def stream_blocks(run: ChatRun, totals: Totals,
                        on_output: Callable[[RequestOutput], None] | None = None) -> AsyncIterator[Block]:
    """The run's output as blocks, as it streams; `totals` joins the output for usage and the stop
    reason, `on_output` sees each output delta before its blocks come. Raises RequestFailed when the
    request fails; the engine request is aborted when the stream ends early (the client left)."""
    parser = OutputParser(thinking=run.prompt.thinking, tools=run.prompt.tools, stream_reasoning=True)
    blocks = _Blocks()
    try:
        async for index, output in run.outputs:
            totals.add(index, output)
            if on_output is not None:
                on_output(output)
            for block in blocks.feed(parser.feed(output.text or "")):
                yield block
            if output.finished:
                for block in blocks.feed(parser.finish()):
                    yield block
        for block in blocks.close():
            yield block
    finally:
        run.group.abort()


class ContentTokens:
    """Which output tokens are the response channel's text, the content (whose logprobs are the
    output_text's). Every K3 marker is one special token, so the channel is read off the token ids:
    the content is the text tokens after `<|open|>response<|sep|>` (from the start in instant mode,
    whose prompt opened the response channel) up to the next special token."""

    def __init__(self, tokenizer, thinking: bool):
        self._tokenizer = tokenizer
        self._open, self._sep = tokenizer.token_id("<|open|>"), tokenizer.token_id("<|sep|>")
        self._in_content = not thinking
        self._header: list[int] | None = None  # the channel name after an opener, until its <|sep|>

    def positions(self, token_ids: list[int]) -> list[int]:
        """The positions in `token_ids`, the output's next tokens, of its content tokens."""
        positions = []
        for i, token in enumerate(token_ids):
            if self._header is not None:
                if token == self._sep:
                    self._in_content = self._tokenizer.decode(self._header) == "response"
                    self._header = None
                else:
                    self._header.append(token)
            elif token == self._open:
                self._header, self._in_content = [], False
            elif token in self._tokenizer.special_ids:
                self._in_content = False
            elif self._in_content:
                positions.append(i)
        return positions


class _Blocks:
    def __init__(self):
        self.open: str | None = None

    def feed(self, delta: Delta) -> Iterator[Block]:
        for kind, text in (("reasoning", delta.reasoning_content), ("text", delta.content)):
            if text:
                if self.open != kind:
                    yield from self.close()
                    yield "open", kind
                    self.open = kind
                yield "text", kind, text
        for call in delta.tool_calls:
            yield from self.close()
            yield "call", call["function"]

    def close(self) -> Iterator[Block]:
        if self.open is not None:
            yield "close", self.open
            self.open = None


def stream_error_message(error: Exception, response_id: str) -> str:
    """What a stream that broke after its headers were sent tells the client: a failed request's
    reason, never an internal error's text (that goes to the log)."""
    if isinstance(error, RequestFailed):
        logger.warning("request %s failed: %s", response_id, error)
        return str(error)
    logger.error("request %s failed", response_id, exc_info=error)
    return "internal error; see the server log"
