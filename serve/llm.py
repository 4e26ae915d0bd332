"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, the engine driven to completion.

`model=None` is the embedded k3-tiny: trained weights shipped in the package (`k3jax/weights/`,
rebuilt by `make weights`, see `k3jax/train/`) and loaded like any other checkpoint.

Images, as vLLM takes them: `generate({"prompt": "... <|kimi_image_placeholder|> ...",
"multi_modal_data": {"image": PIL.Image or a list}})`, one placeholder per image, and `chat` with
`image_url` (data: URLs) or `image_pil` parts; a checkpoint with a vision tower only.
"""

from __future__ import annotations

import os

from k3jax.loading import embedded_dir, from_pretrained
from serve.chat.encoding import tokenize_messages
from serve.engine import Engine, EngineOptions, RequestOutput
from serve.multimodal import chat_prompt, expand_images, load_image
from serve.sampling import SamplingParams

DEFAULT_MODEL = "k3-tiny"


def cache_root() -> str:
    """Where k3jax keeps what it writes for later runs (compiled steps)."""
    return os.environ.get("K3JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "k3jax")


def default_model_dir() -> str:
    """The embedded model's checkpoint directory: k3-tiny trained on Python's reference text in K3's
    chat format (`python -m k3jax.train` writes it), shipped inside the package."""
    return embedded_dir(DEFAULT_MODEL)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when it has no tokenizer files (token-id prompts only)."""
    from serve.chat.tokenizer import Tokenizer  # noqa: PLC0415 (optional part)

    try:
        return Tokenizer.from_dir(path)
    except FileNotFoundError:
        return None


class LLM:
    def __init__(self, model: str | None = None, *, mesh="1x1", dtype: str = "bfloat16", **engine_options):
        path = model or default_model_dir()
        mesh = None if mesh in (None, "1x1") else mesh
        self.model = from_pretrained(path, dtype=dtype, mesh=mesh)
        self.engine = Engine(self.model, EngineOptions(**engine_options), tokenizer=load_tokenizer(path))

    def stats(self) -> dict:
        """The engine's counters: preemptions, prefix-cache hit rate, speculative acceptance."""
        return self.engine.stats()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, a dict {"prompt" (text) or "prompt_token_ids",
        "multi_modal_data": {"image": images}} (vLLM's form), or a list of these. Returns one output per
        prompt, in order. An agent's turns sent with `serve.sessions.SessionParams(prompt_cache_key=...)`
        (an engine with prefix caching) keep their conversation's prefix cached between turns."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return self.engine.generate([self._with_images(p) if isinstance(p, dict) else p for p in prompts], params)

    def chat(self, messages: list, params: SamplingParams | list[SamplingParams] | None = None, *,
             tools: list[dict] | None = None, thinking: bool = True) -> list[RequestOutput]:
        """Conversations in K3's chat format (serve/chat), images included: one conversation (a list of
        messages) or a list of them, as vLLM's LLM.chat. Returns one output per conversation."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        processor = None if self.model.vision is None else self.model.vision.processor
        tokenizer = self.engine.tokenizer
        prompts = [chat_prompt(tokenize_messages(tokenizer, c, tools=tools, thinking=thinking), c, tokenizer, processor)
                   for c in conversations]
        return self.generate(prompts, params)

    def _with_images(self, prompt: dict):
        """vLLM's prompt dict as the engine's prompt: the text or ids, expanded around its images."""
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        data = prompt.get("multi_modal_data") or {}
        if unknown or set(data) - {"image"}:
            raise ValueError(f"prompt: unknown keys {sorted(unknown | (set(data) - {'image'}))} (this model takes "
                             "images only)")
        text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if (text is None) == (ids is None):
            raise ValueError("prompt: give one of 'prompt' (text) and 'prompt_token_ids'")
        images = data.get("image", [])
        images = images if isinstance(images, list) else [images]
        if not images:
            return text if ids is None else ids
        if self.model.vision is None:
            raise ValueError("multi_modal_data: this model has no vision tower; it takes no images")
        tokenizer = self.engine.tokenizer
        ids = tokenizer.encode_prompt(text) if ids is None else ids
        inputs = [load_image(image, self.model.vision.processor, field=f"multi_modal_data.image[{i}]")
                  for i, image in enumerate(images)]
        return expand_images(ids, inputs, tokenizer)
