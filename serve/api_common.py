"""What the HTTP API's endpoints share (serve/api_server.py's OpenAI routes, and the Messages and
Responses routes of serve/api_anthropic.py and serve/api_responses.py): the server's config, the
error that becomes an error response, submitting to the engine, and the test hook's forced output."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from serve import api_checks
from serve.api_protocol import ChatCompletionRequest
from serve.async_engine import AsyncEngine, EngineDead, QueueFull, RequestGroup
from serve.detokenizer import OutputText
from serve.disagg.decode import PrefillError
from serve.multimodal import DEFAULT_IMAGE_LIMIT
from serve.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str  # what clients put in `model`
    model_path: str
    api_key: str | None = None  # when set, /v1 routes need `Authorization: Bearer <api_key>`
    max_body_bytes: int = 16 << 20
    max_n: int = 128  # choices (n, best_of) one request may ask for
    allowed_local_media_path: str | None = None  # file:// image URLs may read under this directory
    limit_mm_per_prompt: int = DEFAULT_IMAGE_LIMIT  # images per prompt
    # TESTING ONLY: lets a chat request force the model's output (`k3jax_test_forced_output`).
    enable_test_hooks: bool = False


RETRY_AFTER_S = 1  # what a 503 tells clients to wait: a queue slot frees when any request finishes


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def forced_tokens(body: ChatCompletionRequest, tokenizer) -> list[int] | None:
    """TESTING ONLY: the tokens `k3jax_test_forced_output` asks the engine's output to be replaced by."""
    forced = getattr(body, "k3jax_test_forced_output", None)
    return None if forced is None else tokenizer.encode(forced, allow_special=True)


async def forced_outputs(group: RequestGroup, forced: list[int], tokenizer, params: list[SamplingParams]
                         ) -> AsyncIterator:
    """TESTING ONLY: the engine's output deltas with their tokens replaced by the next ones of
    `forced` (the engine was asked for exactly that many tokens), detokenized as the engine would
    with choice i's `params[i]`, finishing with "stop" once all of them are out."""
    sent = {}
    texts = {}
    async for index, output in group:
        start = sent.get(index, 0)
        token_ids = forced[start:start + len(output.token_ids)]
        sent[index] = start + len(token_ids)
        text = texts.setdefault(index, OutputText(tokenizer, params[index]))
        for token in token_ids:
            text.feed(token)
        if output.finished:
            text.finish()
        text = text.take(output.finished)
        finish_reason = "stop" if output.finished and sent[index] == len(forced) else output.finish_reason
        yield index, dataclasses.replace(output, token_ids=token_ids, text=text, finish_reason=finish_reason,
                                         logprobs=None)


async def submit(engine: AsyncEngine, requests, rename: dict[str, str] | None = None) -> RequestGroup:
    try:
        await _compile_grammars(engine, requests)
        return await engine.submit(requests)
    except ValueError as error:
        error = api_checks.field_error(error, rename)
        raise APIError(400, str(error), param=error.param) from error
    except (QueueFull, EngineDead) as error:
        raise APIError(503, str(error)) from error
    except PrefillError as error:  # a decode server's prefill (serve/disagg): 503 to retry, else 502
        raise APIError(error.status, str(error)) from error


async def _compile_grammars(engine: AsyncEngine, requests) -> None:
    """Compiles the requests' grammars in a worker thread before they reach the engine, whose
    add_request then finds them compiled (serve/structured.py): a large schema compiled on the
    engine's thread would stall every running request."""
    for spec in dict.fromkeys(p.structured_outputs for _, p in requests if p.structured_outputs is not None):
        await asyncio.to_thread(engine.engine.grammars.compile, spec)


async def unless_disconnected(request: Request, work: Awaitable[dict]) -> dict | Response:
    """Runs `work`, cancelling it if the client disconnects first (its `finally` aborts the engine
    requests). A streaming response notices a disconnect by itself; a plain one would not."""
    work = asyncio.ensure_future(work)
    disconnected = asyncio.ensure_future(disconnect(request))
    await asyncio.wait((work, disconnected), return_when=asyncio.FIRST_COMPLETED)
    disconnected.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def check_model(model: str, config: ServerConfig) -> None:
    if model != config.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


@contextlib.contextmanager
def bad_request():
    """Turns the ValueErrors of request checks (their messages start with the field) into 400s."""
    try:
        yield
    except ValueError as error:
        error = api_checks.field_error(error)
        raise APIError(400, str(error), param=error.param) from error
