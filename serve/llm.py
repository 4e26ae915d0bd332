"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, the engine driven to completion.

`model=None` is the embedded k3-tiny: a synthetic checkpoint written once under the user's cache
directory (`$K3JAX_CACHE` or `~/.cache/k3jax`) and loaded like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

from convert import synth
from k3jax.loading import from_pretrained
from k3jax.presets import PRESETS
from serve.engine import Engine, EngineOptions, RequestOutput
from serve.sampling import SamplingParams

DEFAULT_MODEL = "k3-tiny"
_DEFAULT_SEED = 0


def cache_root() -> str:
    """Where k3jax keeps what it writes for later runs (the embedded model, compiled steps)."""
    return os.environ.get("K3JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "k3jax")


def default_model_dir() -> str:
    """The embedded model's checkpoint directory, written on first use (atomically: a half-written
    directory is never mistaken for a finished one). The name carries a digest of the preset, so a
    cache written by a version whose k3-tiny differs (say, before it had a vision tower) is not read."""
    root = cache_root()
    preset = hashlib.sha256(json.dumps(PRESETS[DEFAULT_MODEL], sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(root, f"{DEFAULT_MODEL}-seed{_DEFAULT_SEED}-{preset}")
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(root, exist_ok=True)
        partial = tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=root)
        synth.write_checkpoint(partial, PRESETS[DEFAULT_MODEL], seed=_DEFAULT_SEED)
        try:
            os.rename(partial, path)
        except OSError:  # another process finished first
            pass
    return path


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
