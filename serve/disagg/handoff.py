"""What a prefill engine hands a decode engine, and the checks that the two engines agree.

A handoff is a prompt's cache after all its tokens but the last: the rows of its pages in every MLA
layer (as stored: fp8 pages stay fp8), and its KDA slot's recurrent state and short-conv window in
every KDA layer, in `serve/kv_offload.py`'s gather layout. The decode engine writes them into pages
and a slot of its own and computes the last prompt token itself, as after a prefix-cache hit, so it
samples every output token (the first one's draw key, penalties, grammar, stop rules and text are
all its own, as vLLM's decode instances do): the prefill side needs no sampling parameters.

`fingerprint` is what must be equal for a handoff to mean the same thing on both sides (the
protocol version, the model's config, a digest of its weights, the activation and cache dtypes and
the page size); `differences` names what is not, and `check_handoff` holds a handoff to an engine's pools.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.kda import KDACache
from k3jax.layers.mla import MLAPages
from serve.sampling import SamplingParams

PROTOCOL = 2  # 2: conv and state keep gather_slots' slot axis


@dataclasses.dataclass(frozen=True)
class Handoff:
    """The cache of a prompt's first `num_tokens` tokens; NumPy or device arrays."""

    num_tokens: int
    pages: object  # [P, MLA layers, page_size, width] in the page dtype; P >= the pages of num_tokens
    conv: object  # [1, KDA layers, conv_size - 1, 3, P] in the activation dtype (one slot, gather_slots' layout)
    state: object  # [1, KDA layers, heads, K, V] float32

    @property
    def arrays(self) -> tuple:
        return self.pages, self.conv, self.state

    def num_pages(self, page_size: int) -> int:
        return -(-self.num_tokens // page_size)

    def page_rows(self, count: int):
        """`pages` with exactly `count` entries on its first axis: cut, or padded with zeros (where they are)."""
        pages = self.pages
        if pages.shape[0] == count:
            return pages
        if isinstance(pages, jax.Array):  # a sequence-parallel prefill's (serve/sequence_parallel_prefill.py)
            pages = pages[:count]
            return jnp.pad(pages, ((0, count - pages.shape[0]),) + ((0, 0),) * (pages.ndim - 1))
        pages = np.asarray(pages)[:count]
        return np.concatenate([pages, np.zeros((count - len(pages), *pages.shape[1:]), pages.dtype)])


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """A prompt whose handoff a prefill server computed: `Engine.add_request` takes it as a prompt and
    starts at its last token."""

    ids: list[int]
    handoff: Handoff


@dataclasses.dataclass(frozen=True)
class PrefillOnly(SamplingParams):
    """The params of a prefill server's request: the engine stops it when its prompt is computed and
    puts its cache on the output (`RequestOutput.handoff`, finish_reason "prefilled"); the token it
    samples there is dropped."""

    temperature: float = 0.0
    max_tokens: int | None = 1


def pool_specs(pools) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """(shape, dtype) of each handoff array that an engine's pools take (pages: past the first axis)."""
    mla = [pool for pool in pools if isinstance(pool, MLAPages)]
    kda = [pool for pool in pools if isinstance(pool, KDACache)]
    return {"pages": ((len(mla), *mla[0].pages.shape[1:]), np.dtype(mla[0].pages.dtype)),
            "conv": ((1, len(kda), *kda[0].conv.shape[1:]), np.dtype(kda[0].conv.dtype)),
            "state": ((1, len(kda), *kda[0].state.shape[1:]), np.dtype(kda[0].state.dtype))}


def check_handoff(handoff: Handoff, ids: list[int], specs: dict, page_size: int) -> None:
    """Raises ValueError naming what of `handoff` does not fit the prompt `ids` or pools of `specs`."""
    if handoff.num_tokens != len(ids) - 1:
        raise ValueError(f"prompt: the prefilled cache holds {handoff.num_tokens} tokens; a prompt of {len(ids)} "
                         f"needs {len(ids) - 1} (all but its last)")
    for name, (shape, dtype) in specs.items():
        array = getattr(handoff, name)
        got = tuple(array.shape[1:] if name == "pages" else array.shape)
        if got != shape or np.dtype(array.dtype) != dtype:
            raise ValueError(f"prompt: the prefilled {name} are {got} {np.dtype(array.dtype).name}; this engine's "
                             f"pools take {shape} {dtype.name} (the prefill engine's config, dtype or "
                             "kv_cache_dtype differs)")
    if handoff.pages.shape[0] < handoff.num_pages(page_size):
        raise ValueError(f"prompt: {handoff.pages.shape[0]} prefilled pages hold fewer than {handoff.num_tokens} "
                         f"tokens of {page_size} a page")


def fingerprint(engine) -> dict:
    """What two engines (serve.engine.Engine) must share for a handoff between them (JSON)."""
    model = engine.model
    specs = pool_specs(engine.runner.pools)
    norm = np.asarray(jax.device_get(model.params["norm"]["weight"].get_value()), np.float32)
    return {"protocol": PROTOCOL,
            "config": json.loads(json.dumps(dataclasses.asdict(model.config))),
            "weights": hashlib.sha256(norm.tobytes()).hexdigest()[:16],  # the final norm's: another checkpoint's
            "dtype": jnp.dtype(model.dtype).name, "kv_cache_dtype": specs["pages"][1].name,
            "block_size": engine.layout.page_size}


def differences(ours: dict, theirs, us: str, them: str) -> list[str]:
    """What differs between two fingerprints, each as "<field>: <ours> (<us>), <theirs> (<them>)"."""
    if not isinstance(theirs, dict):
        return [f"fingerprint: none from the {them} side"]
    out = []
    for key, value in ours.items():
        other = theirs.get(key)
        if key == "config" and isinstance(other, dict):
            out += [f"config.{k}: {value.get(k)!r} ({us}), {other.get(k)!r} ({them})"
                    for k in sorted(set(value) | set(other)) if value.get(k) != other.get(k)]
        elif value != other:
            out.append(f"{key}: {value!r} ({us}), {other!r} ({them})")
    return out
