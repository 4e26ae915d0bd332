"""Request checks of the HTTP server that need the model or the server's limits, and the prompts'
tokenization, all before anything is queued.

Token work runs in worker threads (`asyncio.to_thread`: tiktoken releases the GIL), never on the
event loop or the engine thread, so a huge prompt delays nobody else; a text too long to fit
`max_model_len` whatever its tokens is refused without being tokenized at all. Errors are
`FieldError`s: a 400 whose `param` names the field and whose message speaks the API's words.
"""

from __future__ import annotations

import asyncio
import re

from serve.api_protocol import ChatCompletionRequest
from serve.chat import tokenize_messages

# JSON nesting the free-form fields (tool schemas, messages, chat_template_kwargs) may have: deeper
# structures would exhaust Python's recursion in the encoder, and no real schema comes near.
MAX_NESTING = 32
# A ValueError message that starts with a field's name ("top_k: must be ...", "messages[0].role: ...").
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w]*(?:\[\d+\]|\.[A-Za-z_]\w*)*): ")
# Pydantic's labels of union members and types in an error's location: not field names.
_TYPE_LABELS = {"str", "int", "float", "bool", "list", "dict", "none"}


class FieldError(ValueError):
    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def field_error(error: ValueError, rename: dict[str, str] | None = None) -> FieldError:
    """The ValueError of a check as a FieldError naming the field its message starts with; `rename`
    maps internal names to the request's own (a chat request's "prompt" is its "messages")."""
    if isinstance(error, FieldError):
        return error
    message = str(error)
    match = _FIELD_PREFIX.match(message)
    param = match.group(1) if match else None
    if param is not None and rename and param in rename:
        message = rename[param] + message[len(param):]
        param = rename[param]
    return FieldError(param, message)


def validation_param(location: tuple) -> str | None:
    """The field of a pydantic error location (without "body" and the union members' labels)."""
    parts = []
    for part in location:
        if part == "body":
            continue
        if isinstance(part, str) and (part in _TYPE_LABELS or not re.fullmatch(r"[a-z_][a-z0-9_]*", part)):
            break  # e.g. 'list[int]', "literal['none','auto']", 'NamedToolChoice': a union member
        parts.append(str(part))
    return ".".join(parts) or None


def check_nesting(body: ChatCompletionRequest) -> None:
    """Tool schemas, messages and chat_template_kwargs nest at most MAX_NESTING levels deep."""
    fields = {"tools": [t.function.parameters for t in body.tools or ()], "messages": body.messages,
              "chat_template_kwargs": body.chat_template_kwargs}
    for name, value in fields.items():
        if _deeper_than(value, MAX_NESTING):
            raise FieldError(name, f"{name}: nested more than {MAX_NESTING} levels deep")


def _deeper_than(value, limit: int) -> bool:
    """Whether lists and dicts nest more than `limit` deep (iteratively: no recursion to exhaust)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


async def completion_prompt_ids(prompts: list[str | list[int]], tokenizer, vocab_size: int,
                                max_model_len: int) -> list[list[int]]:
    """The token ids of each prompt (text tokenized in a worker thread), checked: in the
    vocabulary, and leaving room for a token under max_model_len."""
    ids = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise FieldError("prompt", "prompt: this model has no tokenizer files; send token ids, not text")
            # A token covers at most max_token_bytes bytes, hence characters: no need to tokenize to refuse.
            if len(prompt) > tokenizer.max_token_bytes * (max_model_len - 1):
                raise FieldError("prompt", f"prompt: {len(prompt)} characters cannot fit max_model_len="
                                           f"{max_model_len} tokens")
            prompt = await asyncio.to_thread(tokenizer.encode_prompt, prompt)
        elif min(prompt) < 0 or max(prompt) >= vocab_size:
            raise FieldError("prompt", f"prompt: token ids must lie in [0, {vocab_size})")
        check_length("prompt", len(prompt), max_model_len)
        ids.append(prompt)
    return ids


async def chat_prompt_ids(tokenizer, messages: list[dict], max_model_len: int, **options) -> list[int]:
    """The chat prompt's token ids (encoded and tokenized in a worker thread), checked for length;
    messages whose text alone cannot fit are refused without being tokenized."""
    if (length := _text_length(messages)) > tokenizer.max_token_bytes * (max_model_len - 1):
        raise FieldError("messages", f"messages: {length} characters of text cannot fit max_model_len="
                                     f"{max_model_len} tokens")
    try:
        ids = await asyncio.to_thread(tokenize_messages, tokenizer, messages, **options)
    except ValueError as error:
        raise field_error(error) from error
    check_length("messages", len(ids), max_model_len)
    return ids


def _text_length(messages: list) -> int:
    """Characters of the messages' content (strings and text parts): text the prompt surely holds,
    so a lower bound of its tokens times max_token_bytes (the encoder checks the shapes later)."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            total += len(text) if isinstance(text, str) else 0
    return total


def check_length(field: str, num_tokens: int, max_model_len: int) -> None:
    if num_tokens + 1 > max_model_len:
        raise FieldError(field, f"{field}: {num_tokens} tokens; max_model_len={max_model_len} leaves no room to "
                                "generate")
