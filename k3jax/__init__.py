"""k3jax: Kimi K3 (and Kimi Linear) inference on JAX/XLA.

Names are imported lazily so that `k3jax.config` stays a leaf module that `convert` can import
without pulling in the model (and without an import cycle through `from_pretrained`).
"""

import importlib

_EXPORTS = {
    "K3Config": "k3jax.config",
    "K3Model": "k3jax.model",
    "from_pretrained": "k3jax.loading",
    "param_count": "k3jax.sizing",
    "active_param_count": "k3jax.sizing",
    "mla_cache_bytes_per_token": "k3jax.sizing",
    "kda_state_bytes_per_sequence": "k3jax.sizing",
    "LLM": "serve.llm",
    "SamplingParams": "serve.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'k3jax' has no attribute {name!r}")
