"""Images on the Responses route and in /tokenize (serve/api_responses.py, serve/api_tokenize.py),
through the official openai client on one synthetic k3-tiny server with a vision tower. The
references: the chat endpoint, whose image handling has its own tests against the decoder's forward
(tests/serve/test_engine_images.py), and the image's size, which fixes its token count (one
<|media_pad|> per merged 28 x 28 px patch, plus its media run's header and end)."""

import json

import openai
import pytest

from convert import synth
from k3jax.presets import PRESETS
from serve.llm import load_tokenizer
from tests.serve.test_engine_images import noise, png_url
from tests.serve.test_server import MODEL, post, start_server, wait_idle

LIMIT = 2
INSTANT = {"effort": "none"}
PATCH = 28  # px per side of a merged patch: one image token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3-tiny-vision")
    synth.write_checkpoint(path, PRESETS["k3-tiny"], seed=2)
    return str(path)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    noise(6).save(path / "cat.png")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint, media_dir):
    yield from start_server(tmp_path_factory, "--model", checkpoint, "--served-model-name", MODEL,
                            "--max-model-len", "512", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                            "--limit-mm-per-prompt", json.dumps({"image": LIMIT}),
                            "--allowed-local-media-path", str(media_dir))


@pytest.fixture(scope="module")
def text_only(checkpoint):
    """extra_body: no EOS stop, and every special token banned, so each output token is a content
    token whose logprob both APIs return."""
    tokenizer = load_tokenizer(checkpoint)
    return {"ignore_eos": True, "logit_bias": {str(i): -100 for i in tokenizer.special_ids}}


def respond(server, text_only, parts, **kwargs):
    content = [{"type": "input_text", "text": "Describe:"}, *parts]
    return server.client().responses.create(
        model=MODEL, input=[{"role": "user", "content": content}], temperature=0, max_output_tokens=5,
        reasoning=INSTANT, include=["message.output_text.logprobs"], extra_body=text_only, **kwargs)


def chat(server, text_only, parts):
    content = [{"type": "text", "text": "Describe:"}, *parts]
    return server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=5, logprobs=True,
        reasoning_effort="none", extra_body=text_only)


def input_image(url, **extra):
    return {"type": "input_image", "image_url": url, **extra}


def image_tokens(server, width, height) -> int:
    """What an image adds to a prompt: its media run, <|media_begin|> "image WxH" <|media_content|>,
    a pad per merged patch, <|media_end|>."""
    _, body = post(server, "/tokenize", {"model": MODEL, "prompt": f"image {width}x{height}"})
    return json.loads(body)["count"] + 2 + (width // PATCH) * (height // PATCH) + 1


def test_an_input_image_runs_the_chat_endpoints_prompt(server, text_only, media_dir):
    wait_idle(server)
    a = respond(server, text_only, [input_image(png_url(noise(6)), detail="auto")])
    wait_idle(server)
    want = chat(server, text_only, [{"type": "image_url", "image_url": {"url": png_url(noise(6))}}])
    got = a.output[0].content[0].logprobs
    assert [lp.token for lp in got] == [lp.token for lp in want.choices[0].logprobs.content]
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want.choices[0].logprobs.content],
                                                       abs=1e-4)
    assert a.usage.input_tokens == want.usage.prompt_tokens
    text = respond(server, text_only, [])
    assert a.usage.input_tokens - text.usage.input_tokens == image_tokens(server, 168, 112)
    wait_idle(server)
    b = respond(server, text_only, [input_image(png_url(noise(7)))])  # another image, another output
    assert [lp.logprob for lp in b.output[0].content[0].logprobs] != [lp.logprob for lp in got]
    wait_idle(server)
    local = respond(server, text_only, [input_image((media_dir / "cat.png").as_uri(), detail="high")])
    assert [lp.model_dump() for lp in local.output[0].content[0].logprobs] == [lp.model_dump() for lp in got]


@pytest.mark.parametrize(("parts", "param", "message"), [
    ([input_image("https://example.com/cat.png")], "input[0].content[1]", "does not fetch remote images"),
    ([input_image("data:image/png;base64,bm90IGFuIGltYWdl")], "input[0].content[1]", "not an image"),
    ([input_image("file:///etc/passwd")], "input[0].content[1]", "not under the allowed local media path"),
    ([input_image(png_url(noise(0, 28, 28)))] * (LIMIT + 1), f"input[0].content[{LIMIT + 1}]",
     f"at most {LIMIT} images per prompt"),
    ([input_image(png_url(noise(0, 28, 28)), detail="low")], "input[0].content[1].detail", "full detail"),
    ([{"type": "input_image", "file_id": "file-1"}], "input[0].content[1].file_id", "no Files API"),
    ([{"type": "input_image", "detail": "auto"}], "input[0].content[1].image_url", "data: URL"),
], ids=["http", "not-an-image", "outside-media-dir", "over-the-limit", "low-detail", "file-id", "no-url"])
def test_bad_images_are_400s_naming_the_part(server, text_only, parts, param, message):
    with pytest.raises(openai.BadRequestError) as error:  # instructions come first: the part keeps its name
        respond(server, text_only, parts, instructions="Be brief.")
    assert error.value.body["param"] == param and error.value.body["message"].startswith(param + ":")
    assert message in error.value.body["message"]
    assert respond(server, text_only, [input_image(png_url(noise(0, 28, 28)))]).status == "incomplete"


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
