"""vLLM's `prompt_logprobs` on /v1/completions and /v1/chat/completions (serve/prompt_logprobs.py)
through the official `openai` client, against an independent reference: the full forward of
tests/agreement.py's Referee on the server's own weights, log-softmaxed in NumPy."""

import json

import numpy as np
import openai
import pytest

import k3jax
from serve.llm import default_model_dir, load_tokenizer
from serve.sampling import MAX_LOGPROBS
from tests.agreement import FP32, Referee
from tests.serve.test_server import MODEL, TEXT_ONLY, USER, post, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(tmp_path_factory, "--max-model-len", "1024", "--max-num-seqs", "2",
                            "--max-num-batched-tokens", "16", "--max-num-partial-prefills", "1",
                            *TEXT_ONLY)


@pytest.fixture(scope="module")
def reference():
    """(prompt ids -> float64 [T, V] log-softmax of the reference forward, the tokenizer)."""
    path = default_model_dir()
    referee = Referee(k3jax.from_pretrained(path, dtype="float32"), pad=512)  # a chat prompt: ~350 tokens

    def logprobs(ids):
        logits = referee.run(ids).logits.astype(np.float64)
        return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)

    return logprobs, load_tokenizer(path)


def assert_matches_reference(prompt_logprobs, ids, n, reference):
    """vLLM's shape (None first; {id: {logprob, rank, decoded_token}} with the prompt token first,
    then its n best alternatives with ranks 1..n) and the reference's values, ranks within what
    fp32 rounding can move (tokens closer to the prompt token than the tolerance may swap)."""
    logprobs, tokenizer = reference
    want = logprobs(ids)
    tol = 2 * FP32.logits * np.abs(want).max()  # a logprob moves by at most twice the logits' tolerance
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for t in range(1, len(ids)):
        row, entry = want[t - 1], {int(k): v for k, v in prompt_logprobs[t].items()}
        token = ids[t]
        assert next(iter(entry)) == token  # the prompt token first
        assert abs(entry[token]["logprob"] - row[token]) <= tol
        above = np.sum(row > row[token] + tol) + 1
        assert above <= entry[token]["rank"] <= np.sum(row > row[token] - tol) + 1
        top = [k for k in entry if k != token or entry[token]["rank"] <= n]
        assert len(top) == n and sorted(entry[k]["rank"] for k in top) == list(range(1, n + 1))
        assert np.sort(row)[::-1][:n] == pytest.approx([entry[k]["logprob"] for k in
                                                        sorted(top, key=lambda k: entry[k]["rank"])], abs=tol)
        for k, value in entry.items():
            assert value["decoded_token"] == tokenizer.token_bytes(k).decode("utf-8", errors="replace")
            assert abs(value["logprob"] - row[k]) <= tol


def test_completions_prompt_logprobs_match_the_reference(server, reference):
    ids = load_tokenizer(default_model_dir()).encode("Hello there, how are you")
    response = server.client().completions.create(model=MODEL, prompt=[ids, ids[:5]], max_tokens=2, n=2,
                                                  extra_body={"prompt_logprobs": 3})
    choices = sorted(response.choices, key=lambda c: c.index)
    assert choices[0].model_extra["prompt_logprobs"] == choices[1].model_extra["prompt_logprobs"]
    assert_matches_reference(choices[0].model_extra["prompt_logprobs"], ids, 3, reference)
    assert_matches_reference(choices[2].model_extra["prompt_logprobs"], ids[:5], 3, reference)
    assert choices[0].logprobs is None  # prompt_logprobs alone asks for no sampled logprobs


def test_zero_and_the_largest_number_of_alternatives(server, reference):
    ids = list(range(40, 60))
    for n in (0, MAX_LOGPROBS):
        choice = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                                    extra_body={"prompt_logprobs": n}).choices[0]
        assert_matches_reference(choice.model_extra["prompt_logprobs"], ids, n, reference)


def test_echo_with_logprobs_also_returns_prompt_logprobs_as_vllm(server, reference):
    ids = list(range(70, 80))
    choice = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True,
                                                logprobs=2).choices[0]
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert_matches_reference(prompt_logprobs, ids, 2, reference)
    assert choice.logprobs.token_logprobs[1:len(ids)] == [e[str(i)]["logprob"] for e, i in
                                                         zip(prompt_logprobs[1:], ids[1:])]


def test_chat_prompt_logprobs_are_the_encoded_chat_prompts(server, reference):
    response = server.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=1,
                                                       extra_body={"prompt_logprobs": 2})
    status, body = post(server, "/tokenize", {"model": MODEL, "messages": USER})
    ids = json.loads(body)["tokens"]
    assert status == 200 and response.usage.prompt_tokens == len(ids)
    assert_matches_reference(response.model_extra["prompt_logprobs"], ids, 2, reference)


BAD = [({"prompt_logprobs": -2}, "must be -1 or at least 0"), ({"prompt_logprobs": -1}, "whole vocabulary"),
       ({"prompt_logprobs": MAX_LOGPROBS + 1}, f"at most {MAX_LOGPROBS}"),
       ({"prompt_logprobs": 0, "stream": True}, "stream"), ({"prompt_logprobs": "1"}, "prompt_logprobs")]


@pytest.mark.parametrize(("fields", "words"), BAD, ids=[w for _, w in BAD])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bad_prompt_logprobs_is_400_naming_the_field(server, fields, words, endpoint):
    client = server.client()
    stream = fields.get("stream", False)
    extra = {k: v for k, v in fields.items() if k != "stream"}
    with pytest.raises(openai.BadRequestError) as error:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, stream=stream, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, stream=stream, extra_body=extra)
    assert error.value.body["param"] == "prompt_logprobs" and words in error.value.body["message"]


def test_responses_refuses_prompt_logprobs(server):
    with pytest.raises(openai.BadRequestError) as error:
        server.client().responses.create(model=MODEL, input="hi", max_output_tokens=1,
                                         extra_body={"prompt_logprobs": 1})
    assert error.value.body["param"] == "prompt_logprobs"

