"""No request can stall or fail the others (issue 21), against `python -m k3jax.serve` in a subprocess:
bad inputs are refused with a 400 that names the field in the API's words (strict types, bounds,
empty prompts, caps on n and on nesting), before anything is built or queued, while other requests
keep running; the docs routes are off and the test hook is invisible without its flags; a 503 says
when to retry; SIGTERM ends within --shutdown-timeout while a reader has stalled.

One server for the module (its last test stops it), without --enable-test-hooks.
"""

import concurrent.futures
import json
import signal
import socket
import subprocess
import time

import pytest

from tests.serve.test_server import API_KEY, LONG, MODEL, TEXT_ONLY, USER, start_server, wait_idle

MAX_RUNNING, MAX_QUEUED, MAX_N = 2, 4, 4
SHUTDOWN_TIMEOUT_S = 3
VOCAB = 512  # k3-tiny's
AUTH = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(tmp_path_factory, "--max-model-len", "1024", "--max-num-seqs", str(MAX_RUNNING),
                            "--max-num-batched-tokens", "16", "--max-num-partial-prefills", "1",
                            "--max-queued-requests", str(MAX_QUEUED), "--max-n", str(MAX_N),
                            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), *TEXT_ONLY)


def post(server, path: str, body: dict, headers=AUTH) -> tuple[int, dict]:
    status, raw = server.request("POST", path, json.dumps(body).encode(), headers)
    return status, json.loads(raw)


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}


def completion_body(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def open_streams(server, count: int, max_tokens: int = 48) -> list:
    """Streaming completions that are running (or queued) when this returns: each has sent its first chunk."""
    client = server.client()
    streams = [client.completions.create(model=MODEL, prompt="run", max_tokens=max_tokens, temperature=0,
                                         stream=True, extra_body=LONG) for _ in range(count)]
    return streams


def finish(stream) -> tuple[str, int]:
    """(finish reason, completion tokens) of a completion stream read to its end."""
    reason, tokens = None, 0
    for chunk in stream:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            tokens += len(choice.logprobs.tokens) if choice.logprobs else 0
    return reason, tokens


def assert_400(status: int, body: dict, param: str):
    assert status == 400, body
    error = body["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "SamplingParams" not in error["message"] and "Traceback" not in error["message"], error


# --- defect 1: an empty prompt stalled the scheduler's queue --------------------------------------

@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["a", ""], [[1], []]], ids=repr)
def test_empty_prompt_is_refused_while_other_requests_complete(server, prompt):
    streams = open_streams(server, 2, max_tokens=8)
    assert_400(*post(server, "/v1/completions", completion_body(prompt=prompt)), "prompt")
    assert [finish(s)[0] for s in streams] == ["length", "length"]
    assert server.request("GET", "/health")[0] == 200


# --- defect 2: a top_k past int32 failed every request in the step --------------------------------

@pytest.mark.parametrize("top_k", [2 ** 31, VOCAB + 1, -2])
def test_bad_top_k_next_to_running_requests_leaves_them_finishing(server, top_k):
    streams = open_streams(server, 3, max_tokens=8)
    assert_400(*post(server, "/v1/completions", completion_body(top_k=top_k, temperature=1.0)), "top_k")
    assert [finish(s)[0] for s in streams] == ["length"] * 3


def test_top_k_of_the_whole_vocabulary_is_served(server):
    status, body = post(server, "/v1/completions", completion_body(top_k=VOCAB, temperature=1.0, seed=1))
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


# --- defect 4: n had no bound ---------------------------------------------------------------------

@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"n": 200_000}, "n"),
    ("/v1/completions", {"n": MAX_N + 1}, "n"),
    ("/v1/chat/completions", {"n": 200_000}, "n"),
    ("/v1/completions", {"best_of": MAX_N + 1}, "best_of"),
    ("/v1/completions", {"n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {"prompt": ["a"] * 3, "n": 3}, "n"),  # 9 sequences: more than the server holds
])
def test_n_over_the_cap_is_refused(server, path, fields, param):
    body = chat_body(**fields) if "chat" in path else completion_body(**fields)
    assert_400(*post(server, path, body), param)


# --- defect 5: tool schemas nested 1000 deep gave a 500 -------------------------------------------

def nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def test_deeply_nested_fields_are_refused(server):
    """Fields nested deeper than the server allows (here 400 JSON levels) are refused by name; a
    body nested too deep to parse at all (Python's JSON parser stops near 1000) is a 400 too."""
    tool = {"type": "function", "function": {"name": "f", "parameters": nested(200)}}
    assert_400(*post(server, "/v1/chat/completions", chat_body(tools=[tool])), "tools")
    assert_400(*post(server, "/v1/chat/completions", chat_body(chat_template_kwargs={"x": nested(200)})),
               "chat_template_kwargs")
    deep_content = [{"role": "user", "content": [{"type": "text", "text": "hi", "x": nested(200)}]}]
    assert_400(*post(server, "/v1/chat/completions", chat_body(messages=deep_content)), "messages")
    status, raw = server.request("POST", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                 AUTH)
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    # a schema of ordinary depth is fine
    tool = {"type": "function", "function": {"name": "f", "parameters": nested(8)}}
    assert post(server, "/v1/chat/completions", chat_body(tools=[tool]))[0] == 200


def test_an_image_limit_of_0_serves_text_only(server):
    """This module's server runs with --limit-mm-per-prompt '{"image": 0}' (TEXT_ONLY): vLLM's text-only
    mode, in which the embedded model's tower is not loaded. An image part is a 400 naming the part and
    the limit (not the tower: the server was told to take none); text is served beside it."""
    url = "data:image/png;base64,iVBORw0KGgo="
    for path, content in (("/v1/chat/completions", {"type": "image_url", "image_url": {"url": url}}),
                          ("/v1/messages", {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                         "data": url.split(",")[1]}})):
        messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, content]}]
        status, body = post(server, path, chat_body(messages=messages))
        message = body["error"]["message"] if "message" in body["error"] else body["error"]
        assert status == 400 and "messages[0].content[1]: at most 0 images per prompt" in str(message), body
    assert post(server, "/v1/chat/completions", chat_body())[0] == 200


# --- defect 6: a large prompt was tokenized on the engine thread ----------------------------------

def test_a_15_mb_prompt_is_refused_and_a_running_stream_goes_on(server):
    stream = open_streams(server, 1, max_tokens=24)[0]
    chunks = iter(stream)
    next(chunks)
    assert_400(*post(server, "/v1/completions", completion_body(prompt="word " * (3 << 20))), "prompt")
    assert_400(*post(server, "/v1/chat/completions",
                     chat_body(messages=[{"role": "user", "content": "word " * (3 << 20)}])), "messages")
    assert finish(chunks)[0] == "length"


def test_min_tokens_with_3000_stop_token_ids_is_served(server):
    """Every token but "A" (65) is a stop id: banned for the first min_tokens tokens, which are hence
    "A"; the request then stops at the first other token (the sampler's shapes are those of any
    request: tests/serve/test_engine_isolation.py counts the compilations)."""
    stop_ids = [i for i in range(VOCAB) if i != 65] * 6
    status, body = post(server, "/v1/completions", completion_body(max_tokens=8, min_tokens=4, temperature=0,
                                                                    stop_token_ids=stop_ids, ignore_eos=True))
    assert status == 200 and body["choices"][0]["text"].startswith("AAAA"), body
    assert body["usage"]["completion_tokens"] >= 5


# --- defect 8: types, names, logit_bias, docs, Retry-After, the hidden test field -----------------

STRICT_TYPES = [
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 5.5}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": "5"}, "max_completion_tokens"),
    ("/v1/completions", {"n": "1"}, "n"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"temperature": True}, "temperature"),
    ("/v1/completions", {"stream": "true"}, "stream"),
    ("/v1/completions", {"seed": "1"}, "seed"),
    ("/v1/completions", {"stop_token_ids": ["1"]}, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": "yes"}, "stream": True},
     "stream_options.include_usage"),
]


@pytest.mark.parametrize(("path", "fields", "param"), STRICT_TYPES,
                         ids=[f"{'chat' if 'chat' in p else 'completions'}-{json.dumps(f)}" for p, f, _ in STRICT_TYPES])
def test_strict_types_like_openai(server, path, fields, param):
    body = chat_body(**fields) if "chat" in path else completion_body(**fields)
    assert_400(*post(server, path, body), param)


BOUNDS = [
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"top_p": 0}, "top_p"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"temperature": -1}, "temperature"),
    ("/v1/completions", {"temperature": 1e39}, "temperature"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"seed": 2 ** 70}, "seed"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": [VOCAB]}, "prompt"),
    ("/v1/completions", {"prompt": "x" * 1100}, "prompt"),
    ("/v1/completions", {"model": "gpt-5"}, "model"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1100}]}, "messages"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
    ("/v1/completions", {"logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    # fields of OpenAI or vLLM this server does not serve: refused, not silently ignored
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),  # vLLM's bound (tests/serve/test_prompt_logprobs.py)
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM: not in a stream
    # structured outputs the server recognises but cannot honour (tests/serve/test_structured.py serves them)
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "objectx"}}}}, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: @nowhere"}}, "structured_outputs"),
    ("/v1/chat/completions", {"structured_outputs": {"json_object": True},
                              "response_format": {"type": "json_object"}}, "structured_outputs"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BOUNDS,
                         ids=[f"{'chat' if 'chat' in p else 'completions'}-{json.dumps(f)[:40]}" for p, f, _ in BOUNDS])
def test_out_of_bounds_fields_name_the_field(server, path, fields, param):
    body = chat_body(**fields) if "chat" in path else completion_body(**fields)
    status, response = post(server, path, body)
    if param == "model":
        assert status == 404 and response["error"]["param"] == "model"
    else:
        assert_400(status, response, param)


def test_logit_bias_follows_vllm(server):
    """vLLM adds the bias (clamped to [-100, 100]) to the logits before the penalties and the argmax:
    a bias of 100 on a token makes greedy and sampling pick it; the logprobs stay the model's."""
    client = server.client()
    greedy = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0, logprobs=1,
                                       logit_bias={"65": 100}, extra_body=LONG)
    assert greedy.choices[0].text == "AAAA"
    assert all(logprob < 0 for logprob in greedy.choices[0].logprobs.token_logprobs)  # raw: not forced to 0
    sampled = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=1.0, seed=3,
                                        logit_bias={"66": 1000, "65": -100}, extra_body=LONG)
    assert sampled.choices[0].text == "BBBB"


def test_docs_and_schema_are_off(server):
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert server.request("GET", path)[0] == 404
        assert server.request("GET", path, headers=AUTH)[0] == 404


def test_the_test_hook_is_an_unknown_field_without_its_flag(server):
    status, body = post(server, "/v1/chat/completions",
                        chat_body(k3jax_test_forced_output="forced text", temperature=0, max_tokens=3, **LONG))
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert "forced text" not in json.dumps(body)


def test_a_full_server_answers_503_with_retry_after(server):
    capacity = MAX_RUNNING + MAX_QUEUED
    with concurrent.futures.ThreadPoolExecutor(capacity) as pool:
        streams = list(pool.map(lambda _: open_streams(server, 1, max_tokens=400)[0], range(capacity)))
    try:
        connection = socket.create_connection((server.host, server.port), timeout=60)
        body = json.dumps(completion_body()).encode()
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + API_KEY.encode()
                           + b"\r\ncontent-type: application/json\r\ncontent-length: " + str(len(body)).encode()
                           + b"\r\n\r\n" + body)
        head = connection.recv(65536).decode().lower()
        connection.close()
        assert head.startswith("http/1.1 503") and "\r\nretry-after: " in head, head
    finally:
        for stream in streams:
            stream.close()


# --- defect 7: SIGTERM waited without limit for a stalled client (stops the module's server) -----

def test_sigterm_ends_within_the_shutdown_timeout_while_a_client_stalls(server):
    """A client that stalls half-way through its request holds its connection open; SIGTERM waits
    for it --shutdown-timeout seconds at most. (A stalled stream reader holds the connection the
    same way once the socket buffers are full, which takes megabytes: this stall is the quick one.)"""
    wait_idle(server)  # the streams of earlier tests have been aborted
    stalled = socket.create_connection((server.host, server.port), timeout=60)
    body = json.dumps(completion_body()).encode()
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + API_KEY.encode()
                    + b"\r\ncontent-type: application/json\r\ncontent-length: " + str(len(body)).encode()
                    + b"\r\n\r\n" + body[:10])  # and nothing more
    time.sleep(1)
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not stop")
    finally:
        stalled.close()
    assert time.monotonic() - start < SHUTDOWN_TIMEOUT_S + 15  # the timeout, then the engine's last step and exit
