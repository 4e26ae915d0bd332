"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, the engine driven to completion.

`model=None` is the embedded k3-tiny: trained weights shipped in the package (`k3jax/weights/`,
rebuilt by `make weights`, see `k3jax/train/`) and loaded like any other checkpoint.
"""

from __future__ import annotations

import os

import k3jax
from k3jax.loading import from_pretrained
from serve.engine import Engine, EngineOptions, RequestOutput
from serve.sampling import SamplingParams

DEFAULT_MODEL = "k3-tiny"


def cache_root() -> str:
    """Where k3jax keeps what it writes for later runs (compiled steps)."""
    return os.environ.get("K3JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "k3jax")


def default_model_dir() -> str:
    """The embedded model's checkpoint directory: k3-tiny trained on Python's reference text in K3's
    chat format (`python -m k3jax.train` writes it), shipped inside the package."""
    return os.path.join(os.path.dirname(os.path.abspath(k3jax.__file__)), "weights", DEFAULT_MODEL)


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
        """prompts: a string, a list of token ids, or a list of either. Returns one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return self.engine.generate(prompts, params)
