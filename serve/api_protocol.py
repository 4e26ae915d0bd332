"""OpenAI request schemas of the HTTP server, and what they mean for the engine.

Pydantic checks shapes, strict types (as OpenAI's API: "5" and true are not integers, 5.0 is not
one either) and the bounds that need no model; a failure is a 400 naming the field. What depends on
the model or the server (top_k and token ids within the vocabulary, prompt lengths, the cap on n)
is checked by the server, `SamplingParams` and the chat encoder, whose ValueErrors start with the
field's name and also become 400s. Fields OpenAI does not have are vLLM's extensions with vLLM's
names (top_k, min_p, ignore_eos, ..., `chat_template_kwargs`, `structured_outputs`). Unknown fields
are ignored, as vLLM does.

Structured outputs (serve/structured.py) come from `response_format` (json_object, json_schema),
vLLM's `structured_outputs` (json, regex, choice, grammar, json_object) and a forced tool choice
(`tool_choice="required"` or a named function, `parallel_tool_calls=false`); one request uses one
of them. A grammar that cannot be compiled is a 400 naming its field (from the engine's add_request).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from serve.chat.parsing import FORMAT_TOKENS
from serve.sampling import MAX_LOGPROBS, SamplingParams
from serve.sessions import MAX_KEY_CHARS, SessionParams
from serve.structured import StructuredOutputsParams

MAX_STOP_STRINGS = 64  # each costs a search per token
MAX_STOP_CHARS = 1024  # a stream holds back the last (longest stop - 1) characters


class Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class FunctionDefinition(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StructuredOutputsRequest(Strict):
    """vLLM's `structured_outputs` extension: exactly one of the constraints. JSON allows no free
    whitespace unless disable_any_whitespace is false (vLLM's default is the other way round: a
    small model loops on spaces)."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # `json` would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = True

    def params(self, channel: str | None) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_schema, json_object=self.json_object, regex=self.regex,
                                       choice=self.choice, grammar=self.grammar,
                                       whitespace=not self.disable_any_whitespace, channel=channel)


class SamplingRequest(Strict):
    """The fields both completion endpoints share."""

    model: str
    n: int = Field(1, ge=1)  # at most the server's --max-n
    stop: str | list[str] | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions
    top_k: int = Field(0, ge=-1)  # at most the vocabulary
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # around the special tokens the text keeps
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's: the prompt tokens' logprobs and this many alternatives (-1: the whole vocabulary).
    prompt_logprobs: int | None = None
    # OpenAI's: the agent session (conversation) whose prefix the cache keeps pinned between turns
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=MAX_KEY_CHARS)
    # Accepted by OpenAI or vLLM but not served here: refused when set, rather than silently ignored.
    UNSUPPORTED: ClassVar[tuple] = ()  # (field, its value when unused)

    def check_unsupported(self) -> None:
        """ValueError naming the first field set that this server does not serve."""
        for field, neutral in self.UNSUPPORTED:
            if getattr(self, field) != neutral:
                raise ValueError(f"{field}: not supported by this server")

    def num_prompt_logprobs(self) -> int | None:
        """`prompt_logprobs` checked as vLLM checks it (-1 or at least 0, at most MAX_LOGPROBS, which
        -1 exceeds at any real vocabulary; not with stream, whose chunks have no field for them)."""
        n = self.prompt_logprobs
        if n is None:
            return None
        if n < -1:
            raise ValueError(f"prompt_logprobs: must be -1 or at least 0, got {n}")
        if n == -1 or n > MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs: at most {MAX_LOGPROBS} on this server, got {n}"
                             + (" (the whole vocabulary)" if n == -1 else ""))
        if self.stream:
            raise ValueError("prompt_logprobs: not available with stream=true (as in vLLM)")
        return n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, choice: int, *, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None, keep_special_tokens=()) -> SamplingParams:
        """The params of one choice. With a seed, choice i samples with seed + i: the n choices of a
        seeded request differ from each other and are reproducible. They carry the prompt_cache_key."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS or any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
        return SessionParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=None if self.seed is None else self.seed + choice,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens, keep_special_tokens=keep_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(), structured_outputs=structured,
            prompt_cache_key=self.prompt_cache_key)

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias: keys must be token ids, got {key[:20]!r}")
            bias[int(key)] = value
        return bias


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: up to the context limit
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: at most one call (enforced by a grammar)
    # "none" turns thinking off, the others set the thinking effort (spec E)
    reasoning_effort: Literal["none", "low", "high", "max"] | None = None
    # the encoder's switches: thinking (alias enable_thinking) and thinking_effort
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}

    def chat_sampling_params(self, choice: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # The output parser reads the channel markers, which are special tokens: they stay in the text.
        return self.sampling_params(choice, max_tokens=max_tokens, keep_special_tokens=FORMAT_TOKENS,
                                    logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                                    structured=self.structured())

    def structured(self) -> StructuredOutputsParams | None:
        """The constraint of the request's content (after the thinking), or None: from
        response_format, structured_outputs, or the tool choice (over the tools `tool_prompt` declares:
        only the named one for a named choice)."""
        channel = "think" if self.thinking()[0] else "response"
        tools = self.tool_prompt()[0]
        forced = self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))
        one_call = self.parses_tool_calls() and not self.parallel_tool_calls
        sources = [name for name, used in (("response_format", self.response_format not in (None, {"type": "text"})),
                                           ("structured_outputs", self.structured_outputs is not None),
                                           ("tool_choice", forced)) if used]
        if len(sources) > 1:
            raise ValueError(f"{sources[1]}: cannot be combined with {sources[0]} in one request")
        if self.structured_outputs is not None:
            return self.structured_outputs.params(channel)
        if self.response_format not in (None, {"type": "text"}):
            kind = self.response_format.get("type")
            if kind not in ("json_object", "json_schema"):
                raise ValueError(f"response_format.type: {kind!r} is not one of text, json_object, json_schema")
            json_schema = self.response_format.get("json_schema") if kind == "json_schema" else {}
            if not isinstance(json_schema, dict):
                raise ValueError("response_format.json_schema: a json_schema response format needs a json_schema "
                                 "object")
            schema = json_schema.get("schema")
            return StructuredOutputsParams(json=schema, json_object=schema is None,
                                           strict=json_schema.get("strict") is True, channel=channel,
                                           field="response_format")
        if forced or one_call:
            return StructuredOutputsParams(tools=[t["function"] for t in tools], channel=channel,
                                           parallel_tool_calls=self.parallel_tool_calls,
                                           tool_call_required=bool(forced), field="tool_choice")
        return None

    def prompt_options(self) -> dict:
        """The keyword arguments of `serve.chat.tokenize_messages` for this request: every endpoint
        that renders a chat prompt (chat, Messages, Responses, /tokenize) renders it from these."""
        thinking, effort = self.thinking()
        tools, tool_choice = self.tool_prompt()
        return {"tools": tools, "tool_choice": tool_choice, "thinking": thinking, "thinking_effort": effort,
                "response_format": self.response_format}

    def thinking(self) -> tuple[bool, str | None]:
        """(thinking on, thinking effort): from chat_template_kwargs, else from reasoning_effort."""
        kwargs = self.chat_template_kwargs or {}
        effort = None if self.reasoning_effort == "none" else self.reasoning_effort
        thinking = kwargs.get("thinking", kwargs.get("enable_thinking", self.reasoning_effort != "none"))
        if not isinstance(thinking, bool):
            raise ValueError(f"chat_template_kwargs.thinking: must be true or false, got {thinking!r}")
        return thinking, kwargs.get("thinking_effort", effort)

    def tool_prompt(self) -> tuple[list[dict] | None, str | None]:
        """(tools to declare, tool_choice to state in the prompt). A named choice declares only that
        tool and states that a call is required (the grammar of `structured` then forces it)."""
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None
        choice = self.tool_choice
        if choice in ("required", None, "auto", "none"):
            if choice == "required" and not tools:
                raise ValueError("tool_choice: 'required' needs tools")
            return tools, choice if choice in ("required", "none") else None
        named = [tool for tool in tools or () if tool["function"]["name"] == choice.function.name]
        if not named:
            raise ValueError(f"tool_choice: the function {choice.function.name!r} is not among the tools")
        return named, "required"

    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class ChatRequestWithTestHook(ChatCompletionRequest):
    """TESTING ONLY, the chat schema of a server started with --enable-test-hooks (elsewhere the
    field is unknown, hence ignored): the engine's output tokens are replaced by this text's tokens,
    to test the output parsers through the server."""

    k3jax_test_forced_output: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)  # only best_of == n: every generated choice is returned
    echo: bool = False
    suffix: str | None = None

    UNSUPPORTED: ClassVar[tuple] = (*SamplingRequest.UNSUPPORTED, ("suffix", None))

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids; none of them empty."""
        prompt = self.prompt
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompt: must not be empty (nor hold an empty prompt)")
        return prompts

    def completion_sampling_params(self, choice: int) -> SamplingParams:
        structured = self.structured_outputs.params(None) if self.structured_outputs is not None else None
        return self.sampling_params(choice, max_tokens=self.max_tokens, logprobs=self.logprobs, structured=structured)
