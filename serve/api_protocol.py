"""OpenAI request schemas of the HTTP server, and what they mean for the engine.

Pydantic checks shapes and types (a failure is a 400 naming the field); the value ranges are
checked once, by `SamplingParams` and the chat encoder, whose ValueErrors also become 400s. Fields
OpenAI does not have are vLLM's extensions with vLLM's names (top_k, min_p, ignore_eos, ...,
`chat_template_kwargs`). Unknown fields are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from serve.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class SamplingRequest(BaseModel):
    """The fields both completion endpoints share."""

    model: str
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, choice: int, *, max_tokens: int | None, logprobs: int | None,
                        skip_special_tokens: bool) -> SamplingParams:
        """The params of one choice. With a seed, choice i samples with seed + i: the n choices of a
        seeded request differ from each other and are reproducible."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=None if self.seed is None else self.seed + choice,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=skip_special_tokens)


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # None: up to the context limit
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # "none" turns thinking off, the others set the thinking effort (spec E)
    reasoning_effort: Literal["none", "low", "high", "max"] | None = None
    # the encoder's switches: thinking (alias enable_thinking) and thinking_effort
    chat_template_kwargs: dict[str, Any] | None = None
    # TESTING ONLY, refused unless the server runs with --enable-test-hooks: the engine's output
    # tokens are replaced by this text's tokens, to test the output parsers through the server.
    k3jax_test_forced_output: str | None = None

    def chat_sampling_params(self, choice: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        # The output parsers need the channel markers, which are special tokens.
        return self.sampling_params(choice, max_tokens=max_tokens, skip_special_tokens=False,
                                    logprobs=(self.top_logprobs or 0) if self.logprobs else None)

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
        tool and states that a call is required: without constrained decoding, the prompt is how
        the choice reaches the model."""
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


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError("prompt: must not be empty")
        return list(prompt)

    def completion_sampling_params(self, choice: int) -> SamplingParams:
        return self.sampling_params(choice, max_tokens=self.max_tokens, logprobs=self.logprobs,
                                    skip_special_tokens=True)
