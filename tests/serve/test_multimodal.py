"""Images into prompts (serve/multimodal.py): where their bytes may come from, the media runs the
placeholders expand to, and the cache ids that keep two images apart in the prefix cache."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from k3jax.vision.config import ImageProcessorConfig
from k3jax.vision.preprocess import num_image_tokens
from serve.chat.encoding import tokenize_messages
from serve.llm import load_tokenizer
from serve.multimodal import ImageInput, expand_images, image_bytes, load_image

PROCESSOR = ImageProcessorConfig()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from convert import synth
    from k3jax.config import K3Config
    from k3jax.presets import PRESETS

    path = tmp_path_factory.mktemp("tok")
    synth.write_tokenizer(path, K3Config.from_hf_dict(PRESETS["k3-tiny"]))
    return load_tokenizer(str(path))


def png(width, height, color=(200, 30, 40)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_placeholders_expand_to_media_runs_in_order(tokenizer):
    first, second = (load_image(png(w, h), PROCESSOR, field="img") for w, h in ((100, 30), (224, 224)))
    ids = tokenize_messages(tokenizer, [{"role": "user", "content": [
        {"type": "text", "text": "two:"}, {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "image_url", "image_url": {"url": "y"}}]}], thinking=False)
    prompt = expand_images(ids, [first, second], tokenizer)
    pad, begin, content, end = (tokenizer.token_id(t) for t in
                                ("<|media_pad|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>"))
    assert [s.image for s in prompt.spans] == [first, second]
    assert [s.image.num_tokens for s in prompt.spans] == [num_image_tokens(100, 30, PROCESSOR), 64]
    for span, (w, h) in zip(prompt.spans, ((100, 30), (224, 224))):
        head = [begin, *tokenizer.encode(f"image {w}x{h}"), content]
        assert prompt.ids[span.start - len(head):span.start] == head
        assert prompt.ids[span.start:span.end] == [pad] * span.image.num_tokens
        assert prompt.ids[span.end] == end
    assert prompt.ids.count(pad) == sum(s.image.num_tokens for s in prompt.spans)
    assert tokenizer.token_id("<|kimi_image_placeholder|>") not in prompt.ids
    # outside the pads the cache ids are the ids; inside, one key per image above every token id
    keys = np.asarray(prompt.cache_ids)
    inside = np.zeros(len(keys), bool)
    for span in prompt.spans:
        inside[span.start:span.end] = True
        assert len(set(keys[span.start:span.end])) == 1 and keys[span.start] >= 1 << 40
    assert (keys[~inside] == np.asarray(prompt.ids)[~inside]).all()
    assert keys[prompt.spans[0].start] != keys[prompt.spans[1].start]


def test_the_same_pixels_give_the_same_key_and_other_pixels_another(tokenizer):
    ids = [tokenizer.token_id("<|kimi_image_placeholder|>")]
    a, a_again, b = (load_image(png(64, 64, c), PROCESSOR, field="img") for c in ((1, 2, 3), (1, 2, 3), (1, 2, 4)))
    assert expand_images(ids, [a], tokenizer).cache_ids == expand_images(ids, [a_again], tokenizer).cache_ids
    assert expand_images(ids, [a], tokenizer).cache_ids != expand_images(ids, [b], tokenizer).cache_ids
    assert expand_images(ids, [a], tokenizer).ids == expand_images(ids, [b], tokenizer).ids


def test_placeholder_and_image_counts_must_agree(tokenizer):
    image = ImageInput.from_image(png(28, 28), PROCESSOR)
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        expand_images([tokenizer.token_id("<|kimi_image_placeholder|>")], [image, image], tokenizer)


def test_image_urls(tmp_path):
    data = png(30, 20)
    assert image_bytes(data_url(data), field="f") == data
    local = tmp_path / "media" / "cat.png"
    local.parent.mkdir()
    local.write_bytes(data)
    assert image_bytes(f"file://{local}", field="f", allowed_local_media_path=str(local.parent)) == data
    (tmp_path / "secret.png").write_bytes(data)
    cases = [("https://example.com/cat.png", {}, "does not fetch remote images"),
             ("data:image/png,abc", {}, "must be base64"),
             ("data:image/png;base64,@@@", {}, "does not decode"),
             (f"file://{local}", {}, "--allowed-local-media-path"),
             (f"file://{local.parent}/../secret.png", {"allowed_local_media_path": str(local.parent)},
              "not under the allowed"),
             ("ftp://x/y.png", {}, "expected a data: URL")]
    for url, kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            image_bytes(url, field="messages[0].content[1].image_url.url", **kwargs)
        assert str(error.value).startswith("messages[0].content[1].image_url.url: ")


def test_bad_image_bytes_name_the_field():
    for data in (b"not an image", png(40, 40)[:60]):
        with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[0\]: "):
            load_image(data, PROCESSOR, field="messages[0].content[0]")
    with pytest.raises(ValueError, match="over the limit"):
        load_image(png(100, 100), ImageProcessorConfig(max_pixels=5000), field="f")


def test_prefix_cache_keys_images_apart():
    """Two prompts with the same ids whose pads stand for different images share no page; the same
    image again hits the cache (scheduler and prefix cache alone, the steps' bookkeeping by hand)."""
    from serve.cache import CacheAllocator, CacheLayout
    from serve.prefix_cache import PrefixCache
    from serve.scheduler import Request, Scheduler
    from serve.sampling import SamplingParams

    allocator = CacheAllocator(CacheLayout(page_size=4, num_pages=40, num_slots=8), PrefixCache(4))
    scheduler = Scheduler(allocator, max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=64,
                          max_prefill_rows=4)
    prompt = [5, 6, 7, 500, 500, 500, 500, 500, 500, 8, 9, 10, 11]  # 500: a pad token
    keys = {name: prompt[:3] + [(1 << 40) + k] * 6 + prompt[9:] for name, k in (("cat", 1), ("dog", 2))}

    def run(name):
        request = Request(name, list(prompt), SamplingParams(), 0, cache_prompt=keys[name.split("-")[0]])
        scheduler.add(request)
        (admitted, chunk), = scheduler.schedule().prefill
        hit = admitted.computed
        admitted.computed += chunk
        scheduler.register(admitted)  # caches the full pages and the snapshot at the boundary (slot kept)
        scheduler.finish(admitted, "stop")
        return hit

    assert run("cat") == 0
    assert run("dog") == 0  # the same ids, another image: nothing cached for it
    assert run("cat-again") == 12 and run("dog-again") == 12  # each image hits its own pages


def test_images_pair_with_placeholders_in_the_order_the_prompt_renders(tokenizer):
    """Tool results render in their calls' order, whatever order they arrive in: their images follow."""
    from serve.multimodal import chat_prompt

    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "look", "arguments": "{}"}} for i in range(2)]
    first, second = png(28, 28, (1, 1, 1)), png(56, 28, (2, 2, 2))
    messages = [{"role": "user", "content": "look twice"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url", "image_url": {"url": data_url(second)}}]},
                {"role": "tool", "tool_call_id": "c0", "content": [{"type": "image_url", "image_url": {"url": data_url(first)}}]}]
    ids = tokenize_messages(tokenizer, messages, thinking=False)
    prompt = chat_prompt(ids, messages, tokenizer, PROCESSOR)
    assert [s.image.prepared.size for s in prompt.spans] == [(28, 28), (56, 28)]  # c0's image first


def test_image_detail_low_is_refused_and_auto_or_high_read_in_full(tokenizer):
    """Images are always read at full size, so detail "low" cannot be honoured: a 400-worthy error
    naming the field; "auto" and "high" give the same prompt as no detail."""
    from serve.multimodal import chat_prompt

    def prompt_with(image_url):
        messages = [{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                                 {"type": "image_url", "image_url": image_url}]}]
        return chat_prompt(tokenize_messages(tokenizer, messages, thinking=False), messages, tokenizer, PROCESSOR)

    url = data_url(png(56, 28))
    plain = prompt_with({"url": url})
    for detail in ("auto", "high"):
        assert prompt_with({"url": url, "detail": detail}).ids == plain.ids
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]\.image_url\.detail: 'low'"):
        prompt_with({"url": url, "detail": "low"})
