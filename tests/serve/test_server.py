"""The OpenAI-compatible server end to end: `python -m k3jax.serve` in a subprocess on the embedded
k3-tiny, driven by the official `openai` client (raw HTTP where the client cannot send the request).

One server for the module (xdist's loadscope keeps the module on one worker), with small engine
options so that it compiles few step shapes: 2 running sequences, 16-token prefill chunks, 32 more
requests queued.

Tests that compare the outputs of two greedy requests run each alone (`wait_idle` first): the same
step programs on the same inputs, hence bit-identical results. Outputs of other batch shapes add in
other orders; they are compared only on prompts whose margins tests/agreement.py certifies.
"""

import concurrent.futures
import http.client
import json
import os
import select
import subprocess
import sys
import time
import urllib.request

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import k3jax
from serve.llm import default_model_dir, load_tokenizer
from tests.agreement import Referee

API_KEY = "test-key"
MODEL = "k3-tiny"
MAX_RUNNING, MAX_QUEUED = 2, 32
MAX_BODY_BYTES = 1 << 16
STARTUP_TIMEOUT_S = 600
USER = [{"role": "user", "content": "hi"}]
# a server that answers no images: the embedded model's tower is not loaded, nor its image steps compiled
TEXT_ONLY = ("--limit-mm-per-prompt", '{"image": 0}')
LONG = {"ignore_eos": True}  # extra_body: random weights may sample EOS early
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
# Spec F #3: reasoning, an empty response and one call.
TOOL_CALL_OUTPUT = ('Need weather.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>'
                    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
                    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
                    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
                    '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')


class Server:
    def __init__(self, url: str, cache: str | None = None):
        self.url = url  # http://host:port/v1
        self.cache = cache  # the server's K3JAX_CACHE: where its model is
        self.host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
        self.port = int(port)

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=300)

    def request(self, method: str, path: str, body=None, headers=None) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=300)
        connection.request(method, path, body=body, headers=headers or {},
                           encode_chunked=body is not None and not isinstance(body, bytes))
        response = connection.getresponse()
        return response.status, response.read()

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels) -> value."""
        with urllib.request.urlopen(f"http://{self.host}:{self.port}/metrics") as response:
            text = response.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples


def start_server(tmp_path_factory, *args: str, cache: str | None = None):
    """A module fixture's server: `python -m k3jax.serve` on k3-tiny in float32 on a free port, with
    the test API key and `args`; yields its Server and stops it afterwards."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    cache = cache or str(tmp_path_factory.mktemp("cache"))
    env = {**os.environ, "K3JAX_CACHE": cache}
    command = [sys.executable, "-m", "k3jax.serve", "--port", "0", "--dtype", "float32", "--api-key", API_KEY,
               "--log-level", "warning", *args]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        server = Server(_wait_for_url(process, log), cache)
        server.process = process
        yield server
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(tmp_path_factory, "--max-model-len", "1024", "--max-num-seqs", str(MAX_RUNNING),
                            "--max-num-batched-tokens", "16", "--max-num-partial-prefills", "1",
                            "--max-queued-requests", str(MAX_QUEUED), "--max-request-body-bytes", str(MAX_BODY_BYTES),
                            "--enable-test-hooks")


def _wait_for_url(process, log) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while (remaining := deadline - time.monotonic()) > 0:
        if not select.select([process.stdout], [], [], remaining)[0]:
            break
        line = process.stdout.readline()  # the server prints one line, the URL, when it is ready
        if "http://" in line:
            return line.split()[-1]
        if not line and process.poll() is not None:
            break
    pytest.fail(f"the server did not start:\n{log.read_text()[-5000:]}")


def chat(server, **kwargs):
    return server.client().chat.completions.create(**{"model": MODEL, "messages": USER, **kwargs})


def streamed_chat(server, **kwargs) -> tuple[dict, list]:
    """The joined deltas of a one-choice stream: reasoning, content, tool calls, finish reason; and its chunks."""
    chunks = list(chat(server, stream=True, **kwargs))
    joined = {"reasoning_content": "", "content": "", "tool_calls": [], "finish_reason": None}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            joined["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
            joined["content"] += delta.content or ""
            joined["tool_calls"] += delta.tool_calls or []
            joined["finish_reason"] = choice.finish_reason or joined["finish_reason"]
    return joined, chunks


def wait_idle(server, *, pool_full: bool = False) -> None:
    """Polls /metrics until no request runs or waits (aborts are processed between steps), and with
    `pool_full` until every page and slot is back in the free lists."""
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        idle = m["k3jax:num_requests_running"] == 0 and m["k3jax:num_requests_waiting"] == 0
        if idle and (not pool_full or (m["k3jax:cache_free_pages"] == m["k3jax:cache_pages"]
                                       and m["k3jax:cache_free_slots"] == m["k3jax:cache_slots"])):
            return
        assert time.monotonic() < deadline, f"the server did not become idle: {m}"
        time.sleep(0.05)


def alone(server, request, **kwargs):
    """`request(server, **kwargs)` once the server is idle: it runs alone, as one row of the step
    shapes a lone request gets."""
    wait_idle(server)
    return request(server, **kwargs)


def assert_pool_full_and_serving(server):
    """Every page and slot back in the free lists, and a new request completes."""
    wait_idle(server, pool_full=True)
    assert chat(server, max_tokens=3, temperature=0, extra_body=LONG).usage.completion_tokens == 3


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert server.request("GET", "/health") == (200, b'{"status":"ok"}')


def test_greedy_chat_stream_equals_non_stream(server):
    whole = alone(server, chat, max_tokens=12, temperature=0, extra_body=LONG)
    message = whole.choices[0].message
    joined, chunks = alone(server, streamed_chat, max_tokens=12, temperature=0, extra_body=LONG,
                           stream_options={"include_usage": True})
    assert joined["reasoning_content"] == (message.reasoning_content or "")
    assert joined["content"] == (message.content or "")
    assert joined["finish_reason"] == whole.choices[0].finish_reason == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.usage.completion_tokens == 12


@pytest.fixture(scope="module")
def referee(server):
    """The reference of tests/agreement.py over the server's own model (fp32, as the server runs it)."""
    previous = os.environ.get("K3JAX_CACHE")
    os.environ["K3JAX_CACHE"] = server.cache
    try:
        path = default_model_dir()
    finally:
        if previous is None:
            del os.environ["K3JAX_CACHE"]
        else:
            os.environ["K3JAX_CACHE"] = previous
    return Referee(k3jax.from_pretrained(path, dtype="float32"), pad=16), load_tokenizer(path)


def test_completions_whole_stream_batch_and_logprobs(server, referee):
    referee, tokenizer = referee
    client = server.client()
    args = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": LONG}
    # A batch of 4 rows runs other programs than a request alone, so its greedy tokens equal the
    # lone request's only where the margins exceed what rounding can move: a prompt whose referee
    # greedy continuation is stable for all 6 tokens is picked, and then every path within fp32's
    # tolerance gives exactly those tokens.
    for text in ("abc", "The ", "def ", "import ", "Hello", "class "):
        prompt, reference = tokenizer.encode(text), []
        for _ in range(6):
            reference.append(int(referee.run(prompt + reference).logits[-1].argmax()))
        if referee.stable_prefix(prompt, reference) == 6:
            break
    else:
        raise AssertionError("no prompt with six stable greedy tokens")
    whole = alone(server, lambda _: client.completions.create(prompt=text, logprobs=2, **args))
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 6
    assert len(choice.logprobs.tokens) == 6 and all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    streamed = alone(server, lambda _: client.completions.create(prompt=text, stream=True, **args))
    assert "".join(c.choices[0].text for c in streamed) == choice.text  # alone too: bit-identical
    assert choice.text == tokenizer.decode(reference, skip_special_tokens=True)
    batch = client.completions.create(prompt=[prompt, [104, 105]], n=2, **args)
    texts = {c.index: c.text for c in batch.choices}
    assert sorted(texts) == [0, 1, 2, 3] and texts[0] == texts[1] == choice.text


def test_seeded_choices_differ_and_repeat(server):
    def run():  # alone: the same steps, so the same draws (seeded rows do not depend on their neighbours)
        # instant mode: the embedded model's reasoning opens with a fixed sentence that sampling keeps
        choices = alone(server, chat, n=3, max_tokens=8, seed=7,
                        extra_body={**LONG, "chat_template_kwargs": {"thinking": False}}).choices
        return [c.message.content for c in choices]
    first = run()
    assert first == run() and len(set(first)) > 1


def test_chat_logprobs(server):
    choice = chat(server, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, extra_body=LONG).choices[0]
    content = choice.logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob for t in content)  # greedy picks the best token


def test_stop_string_cuts_stream_and_whole_alike(server):
    kwargs = {"max_tokens": 12, "temperature": 0, "extra_body": {**LONG, "chat_template_kwargs": {"thinking": False}}}
    text = alone(server, chat, **kwargs).choices[0].message.content
    stop = text[3:5]
    whole = alone(server, chat, stop=[stop], **kwargs).choices[0]
    joined, _ = alone(server, streamed_chat, stop=[stop], **kwargs)
    assert whole.finish_reason == joined["finish_reason"] == "stop"
    assert whole.message.content == joined["content"] == text[:text.find(stop)]


def test_stop_string_kept_with_include_stop_str_in_output(server):
    kwargs = {"model": MODEL, "prompt": "Once", "max_tokens": 12, "temperature": 0, "extra_body": LONG}
    completions = server.client().completions
    text = alone(server, lambda _, **kw: completions.create(**kw), **kwargs).choices[0].text
    stop = text[3:5]
    kept = alone(server, lambda _, **kw: completions.create(**kw), stop=[stop],
                 **{**kwargs, "extra_body": {**LONG, "include_stop_str_in_output": True}}).choices[0]
    assert kept.finish_reason == "stop" and kept.text == text[:text.find(stop) + len(stop)]


def test_special_tokens_other_than_the_markers_leave_the_content(server):
    """vLLM's skip_special_tokens (default true) on a chat reply: a reserved token the model wrote is
    dropped from the content, while the channel markers still reach the parser; false keeps it."""
    forced = {"k3jax_test_forced_output": "Hi<|reserved_token_300|> there<|close|>response<|sep|>"
                                          "<|close|>message<|sep|>"}
    body = {"chat_template_kwargs": {"thinking": False}, **forced}
    assert chat(server, extra_body=body).choices[0].message.content == "Hi there"
    kept = chat(server, extra_body={**body, "skip_special_tokens": False}).choices[0].message.content
    assert kept == "Hi <|reserved_token_300|>  there"  # spaced both sides, as vLLM joins a kept special token
    kept = chat(server, extra_body={**body, "skip_special_tokens": False, "spaces_between_special_tokens": False})
    assert kept.choices[0].message.content == "Hi<|reserved_token_300|> there"


def test_tool_call_parsed_whole_and_streamed_then_round_trip(server):
    forced = {"k3jax_test_forced_output": TOOL_CALL_OUTPUT}
    choice = chat(server, tools=[WEATHER_TOOL], extra_body=forced).choices[0]
    call = choice.message.tool_calls[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Need weather."
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 16
    joined, _ = streamed_chat(server, tools=[WEATHER_TOOL], extra_body=forced)
    assert joined["finish_reason"] == "tool_calls" and joined["reasoning_content"] == "Need weather."
    assert [(c.function.name, c.function.arguments) for c in joined["tool_calls"]] == \
           [(call.function.name, call.function.arguments)]
    # tool_choice none: the same output is not parsed for calls
    unparsed = chat(server, tools=[WEATHER_TOOL], tool_choice="none", extra_body=forced).choices[0]
    assert unparsed.message.tool_calls is None and unparsed.finish_reason == "stop"
    # the call and its result sent back render into a prompt the engine runs
    history = USER + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    assert chat(server, messages=history, tools=[WEATHER_TOOL], max_tokens=2).choices[0].finish_reason


@pytest.mark.parametrize("switch", [{"reasoning_effort": "none"}, {"chat_template_kwargs": {"thinking": False}},
                                    {"chat_template_kwargs": {"enable_thinking": False}}])
def test_thinking_off_gives_content_only(server, switch):
    forced = {"k3jax_test_forced_output": "Hi there!<|close|>response<|sep|><|close|>message<|sep|>"}
    message = chat(server, extra_body={**forced, **switch}).choices[0].message
    assert message.content == "Hi there!" and message.reasoning_content is None


def test_metrics_count_requests_and_tokens(server):
    before = server.metrics()
    chat(server, max_tokens=5, temperature=0, extra_body=LONG)
    after = server.metrics()
    finished = 'k3jax:request_success_total{finished_reason="length"}'
    assert after[finished] - before.get(finished, 0) == 1
    assert after["k3jax:generation_tokens_total"] - before["k3jax:generation_tokens_total"] == 5
    assert after["k3jax:time_to_first_token_seconds_count"] > before.get("k3jax:time_to_first_token_seconds_count", 0)
    assert after["k3jax:inter_token_latency_seconds_count"] >= 4
    assert 0 <= after["k3jax:kv_cache_usage_perc"] <= 1


BAD_REQUESTS = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"logprobs": True, "top_logprobs": 21}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"temperature": -1}, "temperature"),
    ({"reasoning_effort": "medium"}, "reasoning_effort"),
    ({"messages": [{"role": "user", "content": "x" * 1100}]}, "max_model_len=1024"),
]


@pytest.mark.parametrize(("kwargs", "names"), BAD_REQUESTS, ids=[n for _, n in BAD_REQUESTS])
def test_bad_request_is_400_naming_the_problem(server, kwargs, names):
    with pytest.raises(openai.BadRequestError) as error:
        chat(server, **{"max_tokens": 2, **kwargs})
    assert names in error.value.body["message"] and error.value.body["type"] == "invalid_request_error"


def test_unknown_model_key_path_and_body_errors(server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().chat.completions.create(model="gpt-5", messages=USER)
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    status, body = server.request("GET", "/v1/models")  # no key at all
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    auth = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    status, body = server.request("POST", "/v1/chat/completions", b"{" * (MAX_BODY_BYTES + 1), auth)
    assert status == 413 and "larger than" in json.loads(body)["error"]["message"]
    status, _ = server.request("POST", "/v1/chat/completions", iter([b" " * 4096] * 20), auth)  # chunked, no length
    assert status == 413
    status, body = server.request("POST", "/v1/chat/completions", b"{not json", auth)
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    status, body = server.request("GET", "/v1/nothing", headers=auth)
    assert status == 404 and "error" in json.loads(body)


def test_32_concurrent_streams_complete(server):
    def run(i):
        joined, chunks = streamed_chat(server, max_tokens=4, temperature=0, seed=i, extra_body=LONG,
                                       stream_options={"include_usage": True})
        return joined["finish_reason"], chunks[-1].usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, range(32)))
    assert results == [("length", 4)] * 32


def test_queue_full_is_503_and_closed_streams_free_the_pool(server):
    capacity = MAX_RUNNING + MAX_QUEUED
    with concurrent.futures.ThreadPoolExecutor(capacity) as pool:
        streams = list(pool.map(lambda _: chat(server, stream=True, max_tokens=400, extra_body=LONG), range(capacity)))
    try:
        with pytest.raises(openai.InternalServerError) as error:
            chat(server, max_tokens=2)
        assert error.value.status_code == 503 and "capacity" in error.value.body["message"]
    finally:
        for stream in streams:
            stream.close()
    assert server.metrics()["k3jax:request_rejected_total"] >= 1
    assert_pool_full_and_serving(server)


def test_clients_disconnecting_mid_stream_free_the_pool(server):
    # logprobs: every token's chunk carries it, whether its text shows (random weights may write the
    # message's end marker first, after which the reply's text is over) or not
    streams = [chat(server, stream=True, max_tokens=400, logprobs=True, extra_body=LONG) for _ in range(8)]
    before = server.metrics().get('k3jax:request_success_total{finished_reason="abort"}', 0)
    for stream in streams:  # each gets tokens, then hangs up; the next ones then get a slot
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.role == "assistant"
        assert len(next(chunks).choices[0].logprobs.content) >= 1  # a token
        stream.close()
    assert_pool_full_and_serving(server)
    assert server.metrics()['k3jax:request_success_total{finished_reason="abort"}'] - before == 8


def test_tokenizer_routes_speak_for_the_served_tokenizer(server):
    """/tokenizer_info, /tokenize and /detokenize as lm-evaluation-harness's remote tokenizer calls
    them (no API key: they are open, as in vLLM); a chat body gives the chat endpoint's prompt size."""
    status, body = server.request("GET", "/tokenizer_info")
    info = json.loads(body)
    assert status == 200 and info["eos_token"] == "[EOS]" and info["model_max_length"] == 1024
    status, body = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    eos = json.loads(body)["tokens"]
    assert status == 200 and len(eos) == 1 and eos[0] in load_tokenizer(default_model_dir()).eos_token_ids
    status, body = post(server, "/tokenize", {"prompt": "Hello there"})
    tokens = json.loads(body)["tokens"]
    status, body = post(server, "/detokenize", {"tokens": tokens})
    assert status == 200 and json.loads(body) == {"prompt": "Hello there"}
    usage = chat(server, max_tokens=1).usage.prompt_tokens
    status, body = post(server, "/tokenize", {"model": MODEL, "messages": USER})
    assert status == 200 and json.loads(body)["count"] == usage
    status, body = post(server, "/detokenize", {"tokens": [1, 10 ** 6]})
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"
    status, _ = post(server, "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404


def post(server, path: str, body: dict) -> tuple[int, bytes]:
    return server.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json"})


def test_echo_logprobs_give_k3jax_evals_loglikelihoods(server, referee):
    """lm-evaluation-harness's `local-completions` protocol (token-id prompts of context +
    continuation, max_tokens 1, logprobs 1, echo): the continuation's summed token_logprobs and its
    greedy flag are those `python -m k3jax.eval`'s scorer finds on the same weights."""
    from k3jax.eval.scoring import Scorer

    referee, tokenizer = referee
    rng = np.random.default_rng(7)
    pairs = [(rng.integers(0, 256, n).tolist(), rng.integers(0, 256, m).tolist()) for n, m in ((9, 3), (20, 1), (5, 8))]
    response = server.client().completions.create(model=MODEL, prompt=[c + x for c, x in pairs], max_tokens=1,
                                                  logprobs=1, echo=True, temperature=0)
    scorer = Scorer(referee.model)
    for (context, continuation), choice in zip(pairs, sorted(response.choices, key=lambda c: c.index)):
        ids = context + continuation
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(ids) + 1 and logprobs.token_logprobs[0] is None
        assert logprobs.top_logprobs[0] is None and logprobs.text_offset == sorted(logprobs.text_offset)
        assert choice.text.startswith(tokenizer.decode(ids))
        got = sum(logprobs.token_logprobs[len(context):-1])
        greedy = all(t == max(top.values()) for t, top in zip(logprobs.token_logprobs[len(context):-1],
                                                               logprobs.top_logprobs[len(context):-1]))
        tokens = np.zeros((1, 32), np.int32)
        tokens[0, :len(ids)] = ids
        want, want_greedy = scorer(tokens, np.array([len(ids)]), np.array([len(context)]))
        assert abs(got - float(want[0])) <= 1e-4 * max(1.0, abs(float(want[0]))), (got, want)
        assert greedy == bool(want_greedy[0])


def test_an_image_counts_its_tokens_and_changes_the_greedy_reply(server):
    """The embedded k3-tiny takes images (issue 24): a chat request's image, a PNG data URL, counts in
    usage.prompt_tokens as its media run, <|media_begin|> "image WxH" <|media_content|>, a
    <|media_pad|> per merged 28 x 28 px patch and <|media_end|>; and another image behind the same text
    gives another greedy reply (instant mode: its tiny tower sees no colour, but its output steers the
    reply; with the shipped weights the two replies differ from their first token)."""
    import base64
    import io

    from PIL import Image, ImageDraw

    def shape(fill, draw) -> str:
        image = Image.new("RGB", (112, 84), (128, 128, 128))  # 4 x 3 merged patches
        getattr(ImageDraw.Draw(image), draw)((20, 10, 92, 74), fill=fill)
        out = io.BytesIO()
        image.save(out, "PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()

    def ask(*images):
        content = [*({"type": "image_url", "image_url": {"url": url}} for url in images),
                   {"type": "text", "text": "What is in this picture?"}]
        return alone(server, chat, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=8,
                     reasoning_effort="none", extra_body=LONG)

    red_square, blue_circle = ask(shape((220, 30, 30), "rectangle")), ask(shape((30, 70, 220), "ellipse"))
    media_run = 1 + len(load_tokenizer(default_model_dir()).encode("image 112x84")) + 1 + 4 * 3 + 1
    assert red_square.usage.prompt_tokens == blue_circle.usage.prompt_tokens == ask().usage.prompt_tokens + media_run
    assert red_square.usage.completion_tokens == blue_circle.usage.completion_tokens == 8
    replies = [(r.choices[0].message.content, r.choices[0].message.tool_calls) for r in (red_square, blue_circle)]
    assert replies[0] != replies[1]
