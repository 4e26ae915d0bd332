"""The OpenAI-compatible HTTP API: `build_app(engine, ServerConfig(...))` returns the FastAPI app.

Handlers check the request, tokenize in worker threads (serve/api_checks.py), submit to the
`AsyncEngine` and format what comes back; the engine's device work happens on its own thread, so
the event loop stays free for other clients. A client that goes away (closes a stream or abandons
a non-streaming call) has its requests aborted, which frees their cache pages and slots. Every
error is OpenAI's JSON error object: 400 for a request the server cannot run (its `param` names the
field), 401 for a bad API key, 404 for an unknown model or path, 413 for an oversized body, 503
with Retry-After when the server is full; an exception while serving one request fails only that
one, and its text goes to the log, never into a response. There are no /docs, /redoc or
/openapi.json routes: the schema would show the routes to anyone, API key or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from serve import api_checks
from serve.api_anthropic import add_messages_routes
from serve.api_chat_bridge import chat_inputs
from serve.api_checks import FieldError
from serve.api_common import (APIError, ServerConfig, bad_request, check_model, error_response, forced_outputs,
                              forced_tokens, submit, unless_disconnected)
from serve.api_outputs import ChatChoice, CompletionChoice, Totals
from serve.api_protocol import ChatCompletionRequest, ChatRequestWithTestHook, CompletionRequest
from serve.api_responses import add_responses_routes
from serve.api_tokenize import add_tokenizer_routes
from serve.async_engine import AsyncEngine, RequestFailed
from serve.metrics import CONTENT_TYPE
from serve.prompt_logprobs import PromptScores, prompt_scores

logger = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="k3jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_BodySizeLimit, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(_APIKeyCheck, api_key=config.api_key)
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        if not engine.is_alive():
            raise APIError(503, "the engine has stopped")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "k3jax", "root": config.model_path,
                                            "max_model_len": engine.max_model_len}]}

    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model, config)
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "messages: this model has no tokenizer files, which chat needs; use "
                                "/v1/completions with token ids", param="messages")
        with bad_request():
            body.check_unsupported()
            _check_choices(body.n, 1, config, engine)
            api_checks.check_nesting(body)
            options = body.prompt_options()
            thinking, tools = options["thinking"], options["tools"]
            params = [body.chat_sampling_params(i) for i in range(body.n)]
            num_prompt_logprobs = body.num_prompt_logprobs()
            forced = forced_tokens(body, tokenizer)
            prompt = await api_checks.chat_prompt_ids(tokenizer, body.messages, engine.max_model_len, **options)
            inputs = await asyncio.to_thread(chat_inputs, prompt, body.messages, engine, config)
            if num_prompt_logprobs is not None and inputs is not prompt:  # the scoring forward reads no images
                raise FieldError("prompt_logprobs", "prompt_logprobs: not served for prompts with images")
        if forced is not None:
            params = [dataclasses.replace(p, max_tokens=len(forced), ignore_eos=True) for p in params]
        choices = [ChatChoice(i, tokenizer, thinking=thinking, tools=tools if body.parses_tool_calls() else None,
                              top_logprobs=params[i].logprobs) for i in range(body.n)]
        response = _Response("chatcmpl", "chat.completion", "chat.completion.chunk", config.model_name, body.n)
        # vLLM's prompt_logprobs of a chat request: those of the encoded chat prompt, in the response
        extra = {} if num_prompt_logprobs is None else \
            {"prompt_logprobs": (await _scores(engine, prompt)).vllm(num_prompt_logprobs, tokenizer)}
        group = await submit(engine, [(inputs, p) for p in params], rename={"prompt": "messages"})
        outputs = group if forced is None else forced_outputs(group, forced, tokenizer, params)
        if body.stream:
            return StreamingResponse(response.stream(group, outputs, choices, body.include_usage,
                                                     first=[c.first_delta() for c in choices]),
                                     media_type="text/event-stream")
        return await unless_disconnected(request, response.whole(group, outputs, choices, **extra))

    # The test hook's field exists only in the schema of a server started with its flag.
    chat_completions.__annotations__["body"] = ChatRequestWithTestHook if config.enable_test_hooks \
        else ChatCompletionRequest
    app.post("/v1/chat/completions")(chat_completions)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model, config)
        with bad_request():
            body.check_unsupported()
            prompts = body.prompts()
            _check_choices(body.n, len(prompts), config, engine)
            if body.best_of is not None and body.best_of != body.n:
                raise FieldError("best_of", f"best_of: must equal n ({body.n}): every generated choice is returned")
            params = [body.completion_sampling_params(i) for i in range(body.n)]
            num_prompt_logprobs = body.num_prompt_logprobs()
            texts, prompts = prompts, await api_checks.completion_prompt_ids(prompts, engine.tokenizer,
                                                                             engine.vocab_size, engine.max_model_len)
        echo_logprobs = body.echo and body.logprobs is not None
        if num_prompt_logprobs is None and echo_logprobs:
            num_prompt_logprobs = body.logprobs  # as vLLM: echo's logprobs come back as prompt_logprobs too
        scores = [await _scores(engine, ids) if num_prompt_logprobs is not None else None for ids in prompts]
        echoes = [_echo(engine, text, ids, s.entries(body.logprobs) if echo_logprobs else None)
                  for text, ids, s in zip(texts, prompts, scores)] if body.echo else [None] * len(prompts)
        prompt_logprobs = [None if s is None or body.stream else s.vllm(num_prompt_logprobs, engine.tokenizer)
                           for s in scores]
        choices = [CompletionChoice(i, engine.tokenizer, logprobs=body.logprobs, echo=echoes[i // body.n],
                                    prompt_logprobs=prompt_logprobs[i // body.n])
                   for i in range(len(prompts) * body.n)]
        response = _Response("cmpl", "text_completion", "text_completion", config.model_name, body.n)
        group = await submit(engine, [(prompt, p) for prompt in prompts for p in params])
        if body.stream:
            return StreamingResponse(response.stream(group, group, choices, body.include_usage),
                                     media_type="text/event-stream")
        return await unless_disconnected(request, response.whole(group, group, choices))

    add_messages_routes(app, engine, config)
    add_responses_routes(app, engine, config)
    add_tokenizer_routes(app, engine, config)
    return app


class _Response:
    """The response to one request: its id and the envelope of its (chunk) objects."""

    def __init__(self, id_prefix: str, kind: str, chunk_kind: str, model: str, n: int):
        self.id = f"{id_prefix}-{secrets.token_hex(16)}"
        self.kind = kind
        self.chunk_kind = chunk_kind
        self.model = model
        self.n = n
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    async def whole(self, group: RequestGroup, outputs: AsyncIterator, choices: list, **extra) -> dict:
        totals = Totals(len(choices))
        try:
            async for index, output in outputs:
                totals.add(index, output)
        except RequestFailed as error:
            raise APIError(500, str(error)) from error
        finally:
            group.abort()  # nothing when all finished; frees the cache if the client left
        return self._envelope(self.kind, [choice.whole(totals.outputs[i]) for i, choice in enumerate(choices)],
                              usage=totals.usage(self.n), **extra)

    async def stream(self, group: RequestGroup, outputs: AsyncIterator, choices: list, include_usage: bool,
                     first: Sequence[dict] = ()) -> AsyncIterator[str]:
        """Server-sent events; a disconnect cancels this generator, and `finally` aborts the requests."""
        totals = Totals(len(choices), keep_outputs=False)
        last = ""  # what goes out with [DONE], in one write (each costs the server a send)
        try:
            for choice in first:
                yield _event(self._envelope(self.chunk_kind, [choice]))
            async for index, output in outputs:
                totals.add(index, output)
                if (choice := choices[index].delta(output)) is not None:
                    yield _event(self._envelope(self.chunk_kind, [choice]))
            if include_usage:
                last = _event(self._envelope(self.chunk_kind, [], usage=totals.usage(self.n)))
        except Exception as error:  # headers are sent: the error goes in the stream
            if isinstance(error, RequestFailed):
                message = str(error)
                logger.warning("request %s failed: %s", self.id, message)
            else:
                message = "internal error; see the server log"
                logger.exception("request %s failed", self.id)
            last = _event({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
        finally:
            group.abort()
        yield last + "data: [DONE]\n\n"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _echo(engine: AsyncEngine, text: str | list[int], ids: list[int], entries: list | None):
    """What `echo` puts before a choice: the prompt's text (as sent, or its ids decoded), its ids and,
    with logprobs, their entries."""
    if not isinstance(text, str):
        text = engine.tokenizer.decode(ids) if engine.tokenizer is not None else ""
    return text, ids, entries


async def _scores(engine: AsyncEngine, ids: list[int]) -> PromptScores:
    """The prompt's own logprobs: one more forward of it, in a worker thread beside the engine's."""
    return await asyncio.to_thread(prompt_scores, engine.engine.model, ids)


def _check_choices(n: int, num_prompts: int, config: ServerConfig, engine: AsyncEngine) -> None:
    """n within --max-n, and all sequences within what the server holds: checked before anything
    per choice is built."""
    if n > config.max_n:
        raise FieldError("n", f"n: at most {config.max_n} choices per request on this server, got {n}")
    if n * num_prompts > engine.capacity:
        raise FieldError("n", f"n: {n} choices of {num_prompts} prompts are {n * num_prompts} sequences; this "
                              f"server holds at most {engine.capacity} at once")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        return error_response(error.status, error.message, param=error.param, code=error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request, error: RequestValidationError):
        problems = error.errors()
        problem = problems[0]
        if problem["type"] == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {problem['ctx']['error']}")
        field = api_checks.validation_param(problem["loc"])
        if field is not None and len(problems) > 1 and field == api_checks.validation_param(problems[1]["loc"]):
            message = f"{field}: not one of the accepted types"  # a union: each member's complaint says little
        else:
            message = f"{field}: {problem['msg']}" if field else problem["msg"]
        return error_response(400, message, param=field)

    @app.exception_handler(HTTPException)
    async def http_error(_request, error: HTTPException):  # unknown paths, wrong methods, _BodySizeLimit
        if error.status_code == 400:  # FastAPI could not read the body (e.g. nested too deep to parse)
            return error_response(400, "the body could not be parsed as JSON (or nests too deep)")
        return error_response(error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return error_response(500, "internal error; see the server log")


class _BodySizeLimit:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else as it streams in."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await error_response(413, too_large)(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, too_large)  # FastAPI passes it on from reading the body
            return message

        await self.app(scope, counted_receive, send)


class _APIKeyCheck:
    """401 unless a /v1 request carries `Authorization: Bearer <api_key>`, or `x-api-key: <api_key>` as
    Anthropic's clients send it (health, metrics and the tokenizer routes stay open, as in vLLM)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.bearer, self.key = f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            bearer_ok = secrets.compare_digest(headers.get(b"authorization", b""), self.bearer)
            if not (bearer_ok or secrets.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                return await error_response(401, "invalid or missing API key",
                                            code="invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)
