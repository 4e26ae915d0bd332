"""Images through the engine and the server, against the decoder's own full forward on embeddings
built here: the token table's rows, with each <|media_pad|> run replaced (NumPy) by the vision
encoder's output for its image. The engine gets there through paged prefill chunks that split an image
span, prefix-cache hits that resume inside one, and the encoder cache; all must give the reference's
logprobs and greedy tokens. fp32, on a synthetic k3-tiny with a vision tower and fixed routing (every
token takes the same experts by wide margins: paths compare by value, no router near-ties)."""

import base64
import dataclasses
import functools
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from PIL import Image

from convert import synth
from k3jax.presets import PRESETS
from serve.chat.encoding import tokenize_messages
from serve.llm import LLM
from serve.multimodal import PLACEHOLDER
from serve.sampling import SamplingParams
from tests.agreement import FP32
from tests.serve.test_server import API_KEY, start_server

PAD = 128  # reference forwards are padded to a multiple of this length: few compiles
CHUNK = 16  # the engine's longest prefill chunk (and its page size): a 24-token image spans two chunks
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)


def noise(seed, width=168, height=112) -> Image.Image:  # 168 x 112 px: 6 x 4 merged patches, 24 tokens
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8))


def png_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3-tiny-vision")
    synth.write_checkpoint(path, PRESETS["k3-tiny"], seed=2, fixed_routing=True)
    return str(path)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, dtype="float32", max_prefill_chunk=CHUNK, block_size=CHUNK, enable_prefix_caching=True,
               max_model_len=512)


@pytest.fixture(scope="module")
def recorded(llm):
    """Every step's rows (new tokens, tokens already cached) and embeddings override, as the runner got them."""
    runner, calls = llm.engine.runner, []
    run = runner.run

    def recording(rows, num_rows, num_tokens, **kwargs):
        calls.append(([(list(new), cached) for new, cached, _, _ in rows], kwargs.get("embeds")))
        return run(rows, num_rows, num_tokens, **kwargs)

    runner.run = recording
    yield calls
    runner.run = run


@functools.partial(jax.jit, static_argnums=0)
def _forward(structure, params, tokens, values):
    return structure.merge(params).forward(tokens, embeds=(values, jnp.ones(tokens.shape, bool))).logits


def reference_logits(llm, ids, images) -> np.ndarray:
    """The full forward of `ids` whose k-th run of <|media_pad|> tokens is embedded as the encoder's
    output for images[k]: float32 [len(ids), V]."""
    model = llm.model
    table = np.asarray(model.structure.merge(model.params).embed_tokens[...])
    length = -(-len(ids) // PAD) * PAD
    values = np.zeros((1, length, table.shape[1]), np.float32)
    values[0, :len(ids)] = table[ids]
    pad = llm.engine.tokenizer.token_id("<|media_pad|>")
    is_pad = np.asarray(ids) == pad
    starts = [i for i in range(len(ids)) if is_pad[i] and (i == 0 or not is_pad[i - 1])]
    assert len(starts) == len(images)
    for start, image in zip(starts, images):
        features = model.vision.encode(model.vision.prepare(image))
        assert is_pad[start:start + len(features)].all() and not is_pad[start + len(features):][:1].any()
        values[0, start:start + len(features)] = features
    tokens = np.zeros((1, length), np.int32)
    tokens[0, :len(ids)] = ids
    return np.asarray(_forward(model.structure, model.params, jnp.asarray(tokens), jnp.asarray(values)))[0, :len(ids)]


def check_against_reference(llm, output, images):
    """The output's tokens are the reference's greedy tokens (teacher-forced, wherever the margin is
    wider than fp32's tolerance) and their logprobs the reference's log-softmax."""
    prompt, tokens = output.prompt_token_ids, output.token_ids
    logits = reference_logits(llm, prompt + tokens[:-1], images)[len(prompt) - 1:]
    tol = FP32.logits * np.abs(logits).max()
    logprobs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    for k, (token, entry) in enumerate(zip(tokens, output.logprobs)):
        second, first = np.sort(logits[k])[-2:]
        if first - second > tol:  # else a near-tie either path may take
            assert token == int(np.argmax(logits[k])), f"position {k}"
        assert abs(entry[token] - logprobs[k, token]) <= 2 * tol, f"position {k}"
    return logits


def image_prompt(llm, text, image):
    return {"prompt": text, "multi_modal_data": {"image": image}}


def test_chunked_prefill_and_prefix_cache_hits_inside_an_image_match_the_full_forward(llm, recorded):
    # A prompt whose snapshot boundary (its last full page before its last token) falls inside the
    # image's pads, so that the longer prompt after it resumes from the prefix cache mid-image.
    pad = llm.engine.tokenizer.token_id("<|media_pad|>")
    for k in range(CHUNK):
        text = "x" * k + f"Look: {PLACEHOLDER} ok"
        first = llm.generate(image_prompt(llm, text, noise(0)), GREEDY)[0]
        ids = first.prompt_token_ids
        span = (ids.index(pad), len(ids) - ids[::-1].index(pad))
        boundary = (len(ids) - 1) // CHUNK * CHUNK
        if span[0] < boundary < span[1]:
            break
    else:
        pytest.fail("no prompt put its snapshot boundary inside the image")
    assert span[1] - span[0] == 24
    check_against_reference(llm, first, [noise(0)])
    runs = llm.stats()["encoder_runs"]

    calls = len(recorded)
    longer = text + " and more words after it"
    second = llm.generate(image_prompt(llm, longer, noise(0)), GREEDY)[0]
    same_image = check_against_reference(llm, second, [noise(0)])
    (new, cached), embeds = recorded[calls][0][0], recorded[calls][1]
    assert cached == boundary and new[0] == pad  # resumed from the cache inside the image's pads
    assert (embeds[1][0, :len(new)] == (np.asarray(new) == pad)).all()
    assert llm.stats()["encoder_runs"] == runs  # the encoder cache had the image

    # The same text behind another image: no page of the first image's is reused past its start.
    calls = len(recorded)
    third = llm.generate(image_prompt(llm, longer, noise(1)), GREEDY)[0]
    other_image = check_against_reference(llm, third, [noise(1)])
    assert recorded[calls][0][0][1] <= span[0]
    assert llm.stats()["encoder_runs"] == runs + 1
    assert third.prompt_token_ids == second.prompt_token_ids
    assert np.abs(other_image[0] - same_image[0]).max() > 100 * FP32.logits * np.abs(same_image[0]).max()


def test_a_chunk_that_splits_an_image_gets_its_part_of_the_embeddings(llm, recorded):
    calls = len(recorded)
    output = llm.generate(image_prompt(llm, f"Two: {PLACEHOLDER} and {PLACEHOLDER} end", [noise(2), noise(3, 56, 56)]),
                          GREEDY)[0]
    check_against_reference(llm, output, [noise(2), noise(3, 56, 56)])
    pad = llm.engine.tokenizer.token_id("<|media_pad|>")
    prompt, inside = output.prompt_token_ids, 0
    for rows, embeds in recorded[calls:]:
        for i, (new, cached) in enumerate(rows):
            if len(new) > 1:  # a prefill chunk: the override is set exactly at its pads (None: it has none)
                mask = np.zeros(len(new) + 1, bool) if embeds is None else embeds[1][i]
                assert (mask[:len(new)] == (np.asarray(new) == pad)).all() and not mask[len(new):].any()
                inside += 0 < cached < len(prompt) and prompt[cached - 1] == prompt[cached] == pad
    assert inside, "no chunk started inside an image"


def test_chat_with_an_image_part_and_a_batch_of_several_images(llm):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_pil", "image_pil": noise(4)}]}]
    url = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                        {"type": "image_url", "image_url": {"url": png_url(noise(4))}}]}]
    chats = llm.chat([messages, url], GREEDY)
    assert chats[0].token_ids == chats[1].token_ids and chats[0].prompt_token_ids == chats[1].prompt_token_ids
    tokenizer = llm.engine.tokenizer
    text_ids = tokenize_messages(tokenizer, messages)  # one placeholder for the image:
    head = 1 + len(tokenizer.encode("image 168x112")) + 1  # <|media_begin|>image WxH<|media_content|>
    assert len(chats[0].prompt_token_ids) == len(text_ids) - 1 + head + 24 + 1  # the pads, <|media_end|>
    check_against_reference(llm, chats[0], [noise(4)])
    # several requests with images in one batch, each its own
    prompts = [image_prompt(llm, f"Image {i}: {PLACEHOLDER}.", noise(10 + i)) for i in range(3)]
    for i, output in enumerate(llm.generate(prompts, GREEDY)):
        check_against_reference(llm, output, [noise(10 + i)])


def test_the_encoder_budget_spreads_images_over_steps(checkpoint):
    """With an encoder budget of one image's tokens, a chunk that would reach a second new image ends
    where it starts; the tokens are the reference's all the same."""
    budget = LLM(checkpoint, dtype="float32", max_prefill_chunk=128, max_num_batched_tokens=128, max_model_len=512,
                 max_num_seqs=2, max_num_encoder_input_tokens=24)
    runs, run = [], budget.engine.runner.run

    def recording(rows, num_rows, num_tokens, **kwargs):
        runs.append(([(len(new), cached) for new, cached, _, _ in rows], budget.engine.images.misses))
        return run(rows, num_rows, num_tokens, **kwargs)

    budget.engine.runner.run = recording
    images = [noise(30), noise(31)]
    output = budget.generate(image_prompt(budget, f"A {PLACEHOLDER} B {PLACEHOLDER} C", images), GREEDY)[0]
    check_against_reference(budget, output, images)
    pad = budget.engine.tokenizer.token_id("<|media_pad|>")
    second = [i for i, t in enumerate(output.prompt_token_ids) if t == pad][24]  # the second image's first pad
    assert len(output.prompt_token_ids) < 128  # one chunk would hold the whole prompt
    assert runs[0] == ([(second, 0)], 1) and runs[1] == ([(len(output.prompt_token_ids) - second, second)], 2)


def test_speculative_decoding_with_an_image(checkpoint, tmp_path_factory):
    """A DSpark engine (verify windows over the target, a random draft) on image prompts: its tokens
    are the reference's all the same (the prefills that carry the image are the target's steps)."""
    draft = tmp_path_factory.mktemp("draft")
    synth.main(["--preset", "k3-tiny-dspark", "--out", str(draft), "--seed", "1"])
    spec = LLM(checkpoint, dtype="float32", max_prefill_chunk=CHUNK, block_size=CHUNK, max_model_len=512,
               max_num_seqs=2, enable_prefix_caching=True,
               speculative_config={"method": "dspark", "model": str(draft), "num_speculative_tokens": 3})
    prompts = [image_prompt(spec, f"Look {i}: {PLACEHOLDER} ok", noise(20 + i)) for i in range(2)]
    outputs = spec.generate(prompts, dataclasses.replace(GREEDY, max_tokens=8))
    for i, output in enumerate(outputs):
        check_against_reference(spec, output, [noise(20 + i)])
    assert spec.stats()["spec_num_drafts"] > 0


def test_an_image_the_encoder_fails_on_fails_its_request_alone(llm, monkeypatch):
    """The encoder runs inside the step: a failure there is a failing step, rerun without its culprit."""
    vision, encode = llm.model.vision, llm.model.vision.encode
    bad = vision.prepare(noise(40)).pixel_values

    def failing(prepared):
        if np.array_equal(prepared.pixel_values, bad):
            raise RuntimeError("the encoder failed")
        return encode(prepared)

    monkeypatch.setattr(vision, "encode", failing)
    prompts = [image_prompt(llm, f"Fine {PLACEHOLDER}.", noise(41)), image_prompt(llm, f"Bad {PLACEHOLDER}.", noise(40))]
    good, failed = llm.generate(prompts, GREEDY)
    assert failed.finish_reason == "error" and good.finish_reason == "length"
    monkeypatch.setattr(vision, "encode", encode)
    check_against_reference(llm, good, [noise(41)])


def test_offline_image_errors(llm):
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        llm.generate({"prompt": PLACEHOLDER, "multi_modal_data": {"image": [noise(0), noise(1)]}})
    with pytest.raises(ValueError, match=r"multi_modal_data.image\[0\]: .*not an image"):
        llm.generate({"prompt": PLACEHOLDER, "multi_modal_data": {"image": b"not an image"}})
    with pytest.raises(ValueError, match="images only"):
        llm.generate({"prompt": PLACEHOLDER, "multi_modal_data": {"video": [noise(0)]}})
    assert not llm.engine.has_unfinished()


# The server: images as data: URLs through the official client; every bad image a 400 naming its part.

LIMIT = 2


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    noise(5).save(path / "cat.png")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint, media_dir):
    yield from start_server(tmp_path_factory, "--model", checkpoint, "--served-model-name", "k3-tiny",
                            "--max-model-len", "512", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                            "--limit-mm-per-prompt", json.dumps({"image": LIMIT}),
                            "--allowed-local-media-path", str(media_dir))


def ask(server, image_parts, **kwargs):
    content = [{"type": "text", "text": "Describe:"}, *image_parts]
    return server.client().chat.completions.create(
        model="k3-tiny", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=5,
        logprobs=True, extra_body={"ignore_eos": True, **kwargs.pop("extra_body", {})}, **kwargs)


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_openai_client_sends_an_image_the_model_sees(server, llm, media_dir):
    a, b = (ask(server, [image_part(png_url(noise(seed)))]) for seed in (6, 7))
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe:"},
                                             {"type": "image_pil", "image_pil": noise(6)}]}]
    offline = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0))[0]
    assert a.usage.prompt_tokens == len(offline.prompt_token_ids)  # the image's 24 pads and its header count
    served = [entry.logprob for entry in a.choices[0].logprobs.content]
    assert np.allclose(served, [e[t] for t, e in zip(offline.token_ids, offline.logprobs)], atol=1e-3)
    assert [e.logprob for e in b.choices[0].logprobs.content] != served  # another image, another output
    local = ask(server, [image_part((media_dir / "cat.png").as_uri())])
    assert local.usage.prompt_tokens == a.usage.prompt_tokens


def bomb_png(width=100_000, height=100_000) -> bytes:
    """A PNG header that declares 10^10 pixels (and holds none): refused before any pixel is decoded."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


@pytest.mark.parametrize("parts, message", [
    ([image_part("https://example.com/cat.png")], "does not fetch remote images"),
    ([image_part("data:image/png;base64," + base64.b64encode(b"not an image").decode())], "not an image"),
    ([image_part("data:image/png;base64," + base64.b64encode(bomb_png()).decode())], "over the limit"),
    ([image_part("data:image/png;base64,%%%")], "base64"),
    ([image_part("file:///etc/passwd")], "not under the allowed local media path"),
    ([{"type": "image_url", "image_url": {"detail": "high"}}], "an image part is"),
    ([image_part(png_url(noise(0, 28, 28)))] * (LIMIT + 1), f"at most {LIMIT} images per prompt"),
], ids=["http", "not-an-image", "bomb", "bad-base64", "outside-media-dir", "no-url", "over-the-limit"])
def test_bad_images_are_400s_naming_the_part(server, parts, message):
    with pytest.raises(openai.BadRequestError) as error:
        ask(server, parts)
    assert error.value.body["param"] == f"messages[0].content[{len(parts)}]"
    assert message in error.value.body["message"]
    assert ask(server, [image_part(png_url(noise(0, 28, 28)))]).choices[0].finish_reason == "length"  # still serving


def test_a_model_without_a_vision_tower_refuses_images_by_field():
    """A model without a vision tower (the embedded k3-tiny with its tower dropped): an image part is a
    400 naming it on every route, never a silent 200 (refused before the engine runs a step, so nothing
    compiles here)."""
    from fastapi.testclient import TestClient

    from k3jax.loading import from_pretrained
    from serve.api_common import ServerConfig
    from serve.api_server import build_app
    from serve.async_engine import AsyncEngine
    from serve.engine import Engine
    from serve.llm import default_model_dir, load_tokenizer

    path = default_model_dir()
    model = from_pretrained(path, dtype="float32")
    model.vision = None  # the text model alone, as a checkpoint without vision tensors loads
    app = build_app(AsyncEngine(Engine(model, tokenizer=load_tokenizer(path)), max_queued_requests=4),
                    ServerConfig(model_name="k3-tiny", model_path=path))
    content = [{"type": "text", "text": "hi"}, image_part(png_url(noise(0, 28, 28)))]
    with TestClient(app) as client:
        response = client.post("/v1/chat/completions", json={"model": "k3-tiny", "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": content}]})
        anthropic = client.post("/v1/messages", json={"model": "k3-tiny", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, anthropic_image(noise(0, 28, 28))]}]})
        responses = client.post("/v1/responses", json={"model": "k3-tiny", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is it?"},
            {"type": "input_image", "image_url": png_url(noise(0, 28, 28))}]}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[1].content[1]"
    assert "no vision tower" in response.json()["error"]["message"]
    assert anthropic.status_code == 400
    assert anthropic.json()["error"]["message"].startswith("messages[0].content[1]: this model has no vision tower")
    assert responses.status_code == 400
    assert responses.json()["error"]["message"].startswith("input[0].content[1]: this model has no vision tower")


def anthropic_image(image: Image.Image) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": png_url(image).split(",", 1)[1]}}


def test_anthropic_messages_with_an_image_block(server, llm):
    import anthropic

    from serve.chat import parse_output
    from serve.chat.parsing import FORMAT_TOKENS

    client = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key=API_KEY, max_retries=0, timeout=300)
    content = [{"type": "text", "text": "Describe:"}, anthropic_image(noise(8))]
    reply = client.messages.create(model="k3-tiny", max_tokens=5, messages=[{"role": "user", "content": content}],
                                   extra_body={"temperature": 0})
    counted = client.messages.count_tokens(model="k3-tiny", messages=[{"role": "user", "content": content}])
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe:"},
                                             {"type": "image_pil", "image_pil": noise(8)}]}]
    offline = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=5, keep_special_tokens=FORMAT_TOKENS),
                       thinking=False)[0]  # Anthropic's default: instant mode
    assert reply.usage.input_tokens == counted.input_tokens == len(offline.prompt_token_ids)
    assert "".join(b.text for b in reply.content if b.type == "text") == \
        parse_output(offline.text, thinking=False, tools=None).content
    for block, param in ((anthropic_image(noise(0, 28, 28)) | {"source": {"type": "url", "url": "https://x/y.png"}},
                          "messages[0].content[1].source"),
                         (anthropic_image(noise(0, 28, 28)) | {"source": {"type": "base64", "media_type": "image/png",
                                                                          "data": "aGVsbG8="}}, "messages[0].content[1]")):
        with pytest.raises(anthropic.BadRequestError) as error:
            client.messages.create(model="k3-tiny", max_tokens=1,
                                   messages=[{"role": "user", "content": [content[0], block]}])
        assert error.value.body["error"]["message"].startswith(param + ":")


def test_prompt_logprobs_with_an_image_is_refused_by_field(server):
    """The prompt-scoring forward reads token embeddings only: with an image it would score another
    prompt than the model's, so the field is refused rather than answered wrongly."""
    with pytest.raises(openai.BadRequestError) as error:
        ask(server, [image_part(png_url(noise(0, 28, 28)))], extra_body={"prompt_logprobs": 1})
    assert error.value.body["param"] == "prompt_logprobs"


def test_limit_mm_per_prompt_reads_vllms_json(capsys):
    from k3jax.serve import parse_args

    assert parse_args([]).limit_mm_per_prompt == {"image": 999}  # vLLM V1's default
    assert parse_args(["--limit-mm-per-prompt", '{"image": 4, "video": 0}']).limit_mm_per_prompt == {"image": 4}
    for bad, message in (('{"video": 2}', "images only"), ("image=4", "not JSON"), ('{"image": -1}', "counts")):
        with pytest.raises(SystemExit):
            parse_args(["--limit-mm-per-prompt", bad])
        assert message in capsys.readouterr().err
