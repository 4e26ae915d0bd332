"""Images in /tokenize (serve/api_tokenize.py) on a synthetic k3-tiny server with a vision tower. The
references: the chat endpoint, whose image handling has its own tests against the decoder's forward
(tests/serve/test_engine_images.py), and the image's size, which fixes its token count (one
<|media_pad|> per merged 28 x 28 px patch, plus its media run's header and end)."""

import json

import pytest

from convert import synth
from k3jax.presets import PRESETS
from serve.llm import load_tokenizer
from tests.serve.test_engine_images import noise, png_url
from tests.serve.test_server import MODEL, post, start_server

LIMIT = 2
PATCH = 28  # px per side of a merged patch: one image token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3-tiny-vision")
    synth.write_checkpoint(path, PRESETS["k3-tiny"], seed=2)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    yield from start_server(tmp_path_factory, "--model", checkpoint, "--served-model-name", MODEL,
                            "--max-model-len", "512", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                            "--limit-mm-per-prompt", json.dumps({"image": LIMIT}))


@pytest.fixture(scope="module")
def text_only(checkpoint):
    """extra_body: no EOS stop, and every special token banned, so each output token is a content
    token whose logprob both APIs return."""
    tokenizer = load_tokenizer(checkpoint)
    return {"ignore_eos": True, "logit_bias": {str(i): -100 for i in tokenizer.special_ids}}


def chat(server, text_only, parts):
    content = [{"type": "text", "text": "Describe:"}, *parts]
    return server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=5, logprobs=True,
        reasoning_effort="none", extra_body=text_only)


def image_tokens(server, width, height) -> int:
    """What an image adds to a prompt: its media run, <|media_begin|> "image WxH" <|media_content|>,
    a pad per merged patch, <|media_end|>."""
    _, body = post(server, "/tokenize", {"model": MODEL, "prompt": f"image {width}x{height}"})
    return json.loads(body)["count"] + 2 + (width // PATCH) * (height // PATCH) + 1


@pytest.mark.parametrize(("width", "height"), [(168, 112), (56, 84)])
def test_tokenize_counts_each_image_as_the_engines_prompt(server, text_only, width, height):
    parts = [{"type": "image_url", "image_url": {"url": png_url(noise(3, width, height))}}]
    status, body = post(server, "/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Describe:"}, *parts]}], "reasoning_effort": "none",
        "return_token_strs": True})
    assert status == 200
    out = json.loads(body)
    _, text = post(server, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "Describe:"}],
                                         "reasoning_effort": "none"})
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) == \
        chat(server, text_only, parts).usage.prompt_tokens == json.loads(text)["count"] + image_tokens(server, width,
                                                                                                         height)
    pad = json.loads(post(server, "/tokenize", {"model": MODEL, "prompt": "<|media_pad|>"})[1])["tokens"]
    assert out["tokens"].count(pad[0]) == (width // PATCH) * (height // PATCH)


def test_tokenize_names_a_bad_image(server):
    status, body = post(server, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]}]})
    assert status == 400 and json.loads(body)["error"]["param"] == "messages[0].content[1]"
