"""Images in prompts: where their bytes come from, and the prompt's <|media_pad|> runs they become.

A chat prompt holds one `<|kimi_image_placeholder|>` per image (serve/chat/encoding.py). Each is
expanded, as K3's processor does, to

    <|media_begin|> "image {W}x{H}" <|media_content|> <|media_pad|> x N <|media_end|>

with W x H the image's original size and N its merged patch count (k3jax.vision.preprocess). The
model replaces the embeddings of the N pad positions, in order, with the vision encoder's N outputs.

Pad tokens are the same id for every image, so the prefix cache would take two prompts with the same
text and different images for one prefix. Each prompt therefore also gets `cache_ids`: its ids with
the pad positions of an image replaced by one value derived from the image's content hash, above
any token id (the hash chain reads int64s), which is what the prefix cache hashes.

`chat_images` / `chat_prompt` read a chat request's image parts (the server's and `LLM.chat`'s);
the engine feeds the encoder's outputs to the prefill chunks (serve/encoder_cache.py).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import os
import urllib.parse

from PIL import Image

from k3jax.vision.config import ImageProcessorConfig
from serve.chat.encoding import rendered_order
from k3jax.vision.preprocess import PreparedImage, decode_image, prepare

PLACEHOLDER = "<|kimi_image_placeholder|>"
_CACHE_ID_BASE = 1 << 40  # above every vocabulary: a cache id never equals a token id


@dataclasses.dataclass(frozen=True)
class ImageInput:
    prepared: PreparedImage
    digest: bytes  # the pixels' content hash: keys the encoder's cache and the prefix cache
    num_tokens: int  # <|media_pad|> positions: the merged patches

    @classmethod
    def from_image(cls, image, processor: ImageProcessorConfig) -> ImageInput:
        """From encoded bytes or a Pillow image (ValueError for what is not a usable image)."""
        prepared = prepare(image, processor)
        digest = hashlib.blake2b(prepared.pixel_values.tobytes(), digest_size=16,
                                 person=b"k3jax-image").digest()
        return cls(prepared, digest, prepared.num_patches // processor.merge_kernel_size ** 2)


@dataclasses.dataclass(frozen=True)
class ImageSpan:
    start: int  # the first <|media_pad|> position in the prompt
    image: ImageInput

    @property
    def end(self) -> int:
        return self.start + self.image.num_tokens


@dataclasses.dataclass(frozen=True)
class MultimodalPrompt:
    ids: list[int]
    cache_ids: list[int]  # `ids` with each image's pads replaced by its content key (see the module)
    spans: list[ImageSpan]

    def __len__(self) -> int:  # its tokens, as a prompt of ids counts (usage)
        return len(self.ids)


def image_bytes(url: str, *, field: str, allowed_local_media_path: str | None = None) -> bytes:
    """The bytes behind an image URL: a `data:` URL (base64), or a `file://` URL under
    `allowed_local_media_path` (vLLM's --allowed-local-media-path). The server fetches nothing
    remote. Raises ValueError naming `field`."""
    if not isinstance(url, str):
        raise ValueError(f"{field}: must be a string URL")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ValueError(f"{field}: a data URL must be base64 (data:image/png;base64,...)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise ValueError(f"{field}: the data URL's base64 does not decode: {error}") from error
    if scheme == "file":
        if allowed_local_media_path is None:
            raise ValueError(f"{field}: file:// URLs need the server started with --allowed-local-media-path")
        path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
        root = os.path.realpath(allowed_local_media_path)
        if os.path.commonpath([path, root]) != root:
            raise ValueError(f"{field}: {path} is not under the allowed local media path")
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as error:
            raise ValueError(f"{field}: cannot read {path}: {error.strerror}") from error
    if scheme in ("http", "https"):
        raise ValueError(f"{field}: this server does not fetch remote images; send the image as a data: URL")
    raise ValueError(f"{field}: expected a data: URL (or file:// with --allowed-local-media-path)")


def load_image(data, processor: ImageProcessorConfig, *, field: str) -> ImageInput:
    """Decodes and prepares an image: encoded bytes (the pixel limit checked on the header first) or
    a Pillow image."""
    try:
        if isinstance(data, (bytes, bytearray)):
            data = decode_image(bytes(data), processor)
        elif not isinstance(data, Image.Image):
            raise ValueError(f"expected encoded image bytes or a PIL.Image, got {type(data).__name__}")
        return ImageInput.from_image(data, processor)
    except ValueError as error:
        raise ValueError(f"{field}: {error}") from error


def expand_images(ids: list[int], images: list[ImageInput], tokenizer) -> MultimodalPrompt:
    """Expands the prompt's placeholders, the k-th into images[k]'s media run. Raises ValueError when
    the counts differ."""
    placeholder = tokenizer.token_id(PLACEHOLDER)
    found = sum(1 for t in ids if t == placeholder)
    if found != len(images):
        raise ValueError(f"the prompt holds {found} image placeholders for {len(images)} images")
    begin, content, pad, end = (tokenizer.token_id(name) for name in
                                ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"))
    out, keys, spans, images = [], [], [], iter(images)
    for token in ids:
        if token != placeholder:
            out.append(token)
            keys.append(token)
            continue
        image = next(images)
        width, height = image.prepared.size
        head = [begin, *tokenizer.encode(f"image {width}x{height}"), content]
        key = _CACHE_ID_BASE + int.from_bytes(image.digest[:5], "little")
        spans.append(ImageSpan(len(out) + len(head), image))
        out += head + [pad] * image.num_tokens + [end]
        keys += head + [key] * image.num_tokens + [end]
    return MultimodalPrompt(out, keys, spans)


IMAGE_PART_TYPES = ("image_url", "image", "image_pil")  # what serve/chat/encoding.py renders as a placeholder
DEFAULT_IMAGE_LIMIT = 999  # images per prompt: vLLM V1's default for --limit-mm-per-prompt
IMAGE_DETAILS = ("auto", "high")  # what reading an image at its full size (up to the processor's max_pixels) honours


def chat_images(messages: list, processor: ImageProcessorConfig | None, *, allowed_local_media_path: str | None = None,
                limit: int = DEFAULT_IMAGE_LIMIT) -> list[ImageInput]:
    """The images of chat messages' image parts, in the order the prompt renders their placeholders
    (serve/chat/encoding.py: tool results follow their calls' order). `processor` None: the model has no vision tower, and an
    image is refused. ValueErrors name the part, `messages[i].content[j]`."""
    images = []
    for i, message in rendered_order(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_PART_TYPES:
                continue
            field = f"messages[{i}].content[{j}]"
            if len(images) == limit:  # first: a limit of 0 drops the tower (k3jax.serve)
                raise ValueError(f"{field}: at most {limit} images per prompt on this server (--limit-mm-per-prompt)")
            if processor is None:
                raise ValueError(f"{field}: this model has no vision tower; it takes no images")
            if kind == "image_pil":  # vLLM's offline form: a Pillow image (LLM.chat)
                images.append(load_image(part.get("image_pil"), processor, field=field))
                continue
            url = part.get("image_url")
            detail = url.get("detail", "auto") if isinstance(url, dict) else "auto"
            url = url.get("url") if isinstance(url, dict) else url
            if kind != "image_url" or not isinstance(url, str):
                raise ValueError(f"{field}: an image part is {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}")
            if detail not in IMAGE_DETAILS:
                raise ValueError(f"{field}.image_url.detail: {detail!r} is not supported by this server (one of "
                                 f"{', '.join(IMAGE_DETAILS)}: images are read at full detail)")
            data = image_bytes(url, field=field, allowed_local_media_path=allowed_local_media_path)
            images.append(load_image(data, processor, field=field))
    return images


def chat_prompt(ids: list[int], messages: list, tokenizer, processor: ImageProcessorConfig | None, *,
                allowed_local_media_path: str | None = None, limit: int = DEFAULT_IMAGE_LIMIT):
    """A rendered chat prompt (`ids`, one placeholder per image part) with the messages' images: a
    MultimodalPrompt, or `ids` as they are when the messages hold no image. ValueErrors as `chat_images`."""
    images = chat_images(messages, processor, allowed_local_media_path=allowed_local_media_path, limit=limit)
    return expand_images(ids, images, tokenizer) if images else ids
