"""vLLM's tokenizer endpoints: `/tokenize`, `/detokenize` and `/tokenizer_info`, which let a client
such as lm-evaluation-harness (its `remote` tokenizer) count and cut prompts with the served model's
tokenizer without having its files.

A text prompt is tokenized as `/v1/completions` tokenizes it (special-token text such as `[EOS]`
becomes the special token, as Hugging Face tokenizers and vLLM do: the harness finds the EOS id by
tokenizing the EOS token's text); chat messages as `/v1/chat/completions` renders them, each image
part expanded into the tokens it occupies in the prompt the engine runs (its media run: vLLM's
renderer runs the multimodal processor for /tokenize too, so `count` and `tokens` are those of the
engine's prompt, not of the template's one placeholder per image). K3's prompt format is its Python
encoder, not a Jinja template, so `/tokenizer_info` has no `chat_template`.
The handlers raise ValueErrors that name the field, which the routes answer with 400s.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from serve.api_chat_bridge import chat_inputs
from serve.api_common import APIError, ServerConfig, bad_request, check_model
from serve.api_protocol import ChatCompletionRequest
from serve.async_engine import AsyncEngine
from serve.chat import tokenize_messages
from serve.multimodal import MultimodalPrompt


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as OpenAI and vLLM do

    model: str | None = None
    return_token_strs: bool = False


class TokenizeCompletion(_Body):
    prompt: str
    add_special_tokens: bool = True  # K3 adds none: a prompt is its tokens


class TokenizeChat(ChatCompletionRequest):
    """A chat request's prompt fields (its sampling fields play no part here)."""

    model: str | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class Detokenize(_Body):
    tokens: list[int]


def tokenize(tokenizer, body: TokenizeCompletion | TokenizeChat, max_model_len: int,
             with_images: Callable[[list[int], list], list[int] | MultimodalPrompt]) -> dict:
    """`with_images(ids, messages)`: a rendered chat prompt with its messages' images expanded, as
    serve/multimodal.chat_prompt gives it."""
    if isinstance(body, TokenizeChat):
        ids = tokenize_messages(tokenizer, body.messages, add_generation_prompt=body.add_generation_prompt,
                                **body.prompt_options())
        prompt = with_images(ids, body.messages)
        ids = prompt.ids if isinstance(prompt, MultimodalPrompt) else prompt
    else:
        ids = tokenizer.encode_prompt(body.prompt)
    out = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [tokenizer.token_bytes(i).decode("utf-8", errors="replace") for i in ids]
    return out


def detokenize(tokenizer, body: Detokenize, vocab_size: int) -> dict:
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise ValueError(f"tokens: token ids must lie in [0, {vocab_size})")
    return {"prompt": tokenizer.decode(body.tokens)}


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    return {"tokenizer_class": "TikTokenTokenizer", "vocab_size": tokenizer.vocab_size,
            "model_max_length": max_model_len, "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
            "added_tokens_decoder": {str(i): {"content": name, "special": True}
                                     for name, i in sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])}}


def add_tokenizer_routes(app: FastAPI, engine: AsyncEngine, config: ServerConfig) -> None:
    def tokenizer_of(field: str):
        if engine.tokenizer is None:
            raise APIError(400, f"{field}: this model has no tokenizer files", param=field)
        return engine.tokenizer

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeChat | TokenizeCompletion):
        if body.model is not None:
            check_model(body.model, config)
        tokenizer = tokenizer_of("messages" if isinstance(body, TokenizeChat) else "prompt")
        with bad_request():  # tiktoken releases the GIL: a long prompt keeps the event loop free
            return await asyncio.to_thread(tokenize, tokenizer, body, engine.max_model_len,
                                           functools.partial(chat_inputs, engine=engine, config=config))

    @app.post("/detokenize")
    async def detokenize_route(body: Detokenize):
        if body.model is not None:
            check_model(body.model, config)
        with bad_request():
            return detokenize(tokenizer_of("tokens"), body, engine.vocab_size)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        return tokenizer_info(tokenizer_of("tokenizer"), engine.max_model_len)
