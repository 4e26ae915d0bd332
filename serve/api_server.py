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
from serve.api_checks import FieldError
from serve.api_outputs import ChatChoice, CompletionChoice, Totals
from serve.api_protocol import ChatCompletionRequest, ChatRequestWithTestHook, CompletionRequest
from serve.async_engine import AsyncEngine, EngineDead, QueueFull, RequestFailed, RequestGroup
from serve.metrics import CONTENT_TYPE

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str  # what clients put in `model`
    model_path: str
    api_key: str | None = None  # when set, /v1 routes need `Authorization: Bearer <api_key>`
    max_body_bytes: int = 16 << 20
    max_n: int = 128  # choices (n, best_of) one request may ask for
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
        _check_model(body.model, config)
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "messages: this model has no tokenizer files, which chat needs; use "
                                "/v1/completions with token ids", param="messages")
        with _bad_request():
            body.check_unsupported()
            _check_choices(body.n, 1, config, engine)
            api_checks.check_nesting(body)
            thinking, effort = body.thinking()
            tools, tool_choice = body.tool_prompt()
            params = [body.chat_sampling_params(i) for i in range(body.n)]
            forced = _forced_tokens(body, tokenizer)
            prompt = await api_checks.chat_prompt_ids(tokenizer, body.messages, engine.max_model_len, tools=tools,
                                                      thinking=thinking, thinking_effort=effort,
                                                      tool_choice=tool_choice, response_format=body.response_format)
        if forced is not None:
            params = [dataclasses.replace(p, max_tokens=len(forced), ignore_eos=True) for p in params]
        choices = [ChatChoice(i, tokenizer, thinking=thinking, tools=tools if body.parses_tool_calls() else None,
                              top_logprobs=params[i].logprobs) for i in range(body.n)]
        response = _Response("chatcmpl", "chat.completion", "chat.completion.chunk", config.model_name, body.n)
        group = await _submit(engine, [(prompt, p) for p in params], rename={"prompt": "messages"})
        outputs = group if forced is None else _forced_outputs(group, forced, tokenizer)
        if body.stream:
            return StreamingResponse(response.stream(group, outputs, choices, body.include_usage,
                                                     first=[c.first_delta() for c in choices]),
                                     media_type="text/event-stream")
        return await _unless_disconnected(request, response.whole(group, outputs, choices))

    # The test hook's field exists only in the schema of a server started with its flag.
    chat_completions.__annotations__["body"] = ChatRequestWithTestHook if config.enable_test_hooks \
        else ChatCompletionRequest
    app.post("/v1/chat/completions")(chat_completions)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, config)
        with _bad_request():
            body.check_unsupported()
            prompts = body.prompts()
            _check_choices(body.n, len(prompts), config, engine)
            if body.best_of is not None and body.best_of != body.n:
                raise FieldError("best_of", f"best_of: must equal n ({body.n}): every generated choice is returned")
            params = [body.completion_sampling_params(i) for i in range(body.n)]
            prompts = await api_checks.completion_prompt_ids(prompts, engine.tokenizer, engine.vocab_size,
                                                             engine.max_model_len)
        choices = [CompletionChoice(i, engine.tokenizer, logprobs=body.logprobs) for i in range(len(prompts) * body.n)]
        response = _Response("cmpl", "text_completion", "text_completion", config.model_name, body.n)
        group = await _submit(engine, [(prompt, p) for prompt in prompts for p in params])
        if body.stream:
            return StreamingResponse(response.stream(group, group, choices, body.include_usage),
                                     media_type="text/event-stream")
        return await _unless_disconnected(request, response.whole(group, group, choices))

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

    async def whole(self, group: RequestGroup, outputs: AsyncIterator, choices: list) -> dict:
        totals = Totals(len(choices))
        try:
            async for index, output in outputs:
                totals.add(index, output)
        except RequestFailed as error:
            raise APIError(500, str(error)) from error
        finally:
            group.abort()  # nothing when all finished; frees the cache if the client left
        return self._envelope(self.kind, [choice.whole(totals.outputs[i]) for i, choice in enumerate(choices)],
                              usage=totals.usage(self.n))

    async def stream(self, group: RequestGroup, outputs: AsyncIterator, choices: list, include_usage: bool,
                     first: Sequence[dict] = ()) -> AsyncIterator[str]:
        """Server-sent events; a disconnect cancels this generator, and `finally` aborts the requests."""
        totals = Totals(len(choices), keep_outputs=False)
        try:
            for choice in first:
                yield _event(self._envelope(self.chunk_kind, [choice]))
            async for index, output in outputs:
                totals.add(index, output)
                if (choice := choices[index].delta(output)) is not None:
                    yield _event(self._envelope(self.chunk_kind, [choice]))
            if include_usage:
                yield _event(self._envelope(self.chunk_kind, [], usage=totals.usage(self.n)))
        except Exception as error:  # headers are sent: the error goes in the stream
            if isinstance(error, RequestFailed):
                message = str(error)
                logger.warning("request %s failed: %s", self.id, message)
            else:
                message = "internal error; see the server log"
                logger.exception("request %s failed", self.id)
            yield _event({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
        finally:
            group.abort()
        yield "data: [DONE]\n\n"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _check_choices(n: int, num_prompts: int, config: ServerConfig, engine: AsyncEngine) -> None:
    """n within --max-n, and all sequences within what the server holds: checked before anything
    per choice is built."""
    if n > config.max_n:
        raise FieldError("n", f"n: at most {config.max_n} choices per request on this server, got {n}")
    if n * num_prompts > engine.capacity:
        raise FieldError("n", f"n: {n} choices of {num_prompts} prompts are {n * num_prompts} sequences; this "
                              f"server holds at most {engine.capacity} at once")


def _forced_tokens(body: ChatCompletionRequest, tokenizer) -> list[int] | None:
    """TESTING ONLY: the tokens `k3jax_test_forced_output` asks the engine's output to be replaced by."""
    forced = getattr(body, "k3jax_test_forced_output", None)
    return None if forced is None else tokenizer.encode(forced, allow_special=True)


async def _forced_outputs(group: RequestGroup, forced: list[int], tokenizer) -> AsyncIterator:
    """TESTING ONLY: the engine's output deltas with their tokens replaced by the next ones of
    `forced` (the engine was asked for exactly that many tokens), finishing with "stop" once all of
    them are out."""
    sent = {}
    decoders = {}
    async for index, output in group:
        start = sent.get(index, 0)
        token_ids = forced[start:start + len(output.token_ids)]
        sent[index] = start + len(token_ids)
        decoder = decoders.setdefault(index, tokenizer.incremental_decoder())
        text = "".join(decoder.feed(t) for t in token_ids) + (decoder.finish() if output.finished else "")
        finish_reason = "stop" if output.finished and sent[index] == len(forced) else output.finish_reason
        yield index, dataclasses.replace(output, token_ids=token_ids, text=text, finish_reason=finish_reason,
                                         logprobs=None)


async def _submit(engine: AsyncEngine, requests, rename: dict[str, str] | None = None) -> RequestGroup:
    try:
        return await engine.submit(requests)
    except ValueError as error:
        error = api_checks.field_error(error, rename)
        raise APIError(400, str(error), param=error.param) from error
    except (QueueFull, EngineDead) as error:
        raise APIError(503, str(error)) from error


async def _unless_disconnected(request: Request, work: Awaitable[dict]) -> dict | Response:
    """Runs `work`, cancelling it if the client disconnects first (its `finally` aborts the engine
    requests). A streaming response notices a disconnect by itself; a plain one would not."""
    work = asyncio.ensure_future(work)
    disconnected = asyncio.ensure_future(_disconnect(request))
    await asyncio.wait((work, disconnected), return_when=asyncio.FIRST_COMPLETED)
    disconnected.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _check_model(model: str, config: ServerConfig) -> None:
    if model != config.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


@contextlib.contextmanager
def _bad_request():
    """Turns the ValueErrors of request checks (their messages start with the field) into 400s."""
    try:
        yield
    except ValueError as error:
        error = api_checks.field_error(error)
        raise APIError(400, str(error), param=error.param) from error


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
    """401 unless a /v1 request carries `Authorization: Bearer <api_key>` (health and metrics stay open)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                return await error_response(401, "invalid or missing API key",
                                            code="invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)
