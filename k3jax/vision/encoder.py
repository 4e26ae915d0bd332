"""VisionEncoder: a loaded vision tower with its image-processor config; images -> text-width embeddings.

`load_vision_encoder` fills the tower from the checkpoint's `vision_tower.*` / `mm_projector.*`
tensors (layout in `convert.vision_layout`). A checkpoint without them, or a text-only config, gives
None: the text model loads as before.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from convert.reader import CheckpointError, SafetensorsReader
from convert.vision_layout import vision_rules
from k3jax.config import K3Config
from k3jax.vision.config import DEFAULT_MAX_PIXELS, ImageProcessorConfig, VisionConfig, vision_config
from k3jax.vision.preprocess import PreparedImage, prepare
from k3jax.vision.tower import VisionTower
from sharding.axes import named_sharding

_PREFIXES = ("vision_tower.", "mm_projector.")
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _encode(graphdef, params, pixel_values, grid_hw):
    return nnx.merge(graphdef, params)(pixel_values, grid_hw)


class VisionEncoder:
    """The tower's parameters (`params`), its config and the image-processor config."""

    def __init__(self, cfg: VisionConfig, processor: ImageProcessorConfig, graphdef, params, mesh=None):
        self.config, self.processor = cfg, processor
        self.graphdef = graphdef
        self.params = params if mesh is None else _place(params, mesh)

    @classmethod
    def random(cls, cfg: VisionConfig, processor: ImageProcessorConfig | None = None, *, dtype="float32",
               seed: int = 0) -> "VisionEncoder":
        graphdef, params = nnx.split(VisionTower(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed)))
        return cls(cfg, processor or ImageProcessorConfig(), graphdef, params)

    def prepare(self, image) -> PreparedImage:
        """Encoded bytes or a Pillow image -> patches (`k3jax.vision.preprocess`)."""
        return prepare(image, self.processor)

    def encode(self, image: PreparedImage | bytes) -> np.ndarray:
        """One image -> float32 [tokens, text_hidden]: the embeddings of its <|media_pad|> positions in order."""
        if not isinstance(image, PreparedImage):
            image = self.prepare(image)
        out = _encode(self.graphdef, self.params, jnp.asarray(image.pixel_values), tuple(map(int, image.grid_hw)))
        return np.asarray(out, np.float32)


def load_vision_encoder(path: str | os.PathLike, cfg: K3Config, *, dtype="bfloat16", mesh=None,
                        max_pixels: int = DEFAULT_MAX_PIXELS) -> VisionEncoder | None:
    """The vision encoder of the safetensors checkpoint at `path`, or None when it has no vision tower."""
    vcfg = vision_config(cfg)
    reader = SafetensorsReader(path)
    stored = [n for n in reader.names() if n.startswith(_PREFIXES)]
    if vcfg is None or not stored:
        return None
    processor = ImageProcessorConfig.from_pretrained(path, max_pixels=max_pixels)
    return encoder_from_tensors(vcfg, processor, set(stored), lambda rule: _read(reader, rule), dtype=dtype, mesh=mesh)


def encoder_from_tensors(vcfg: VisionConfig, processor: ImageProcessorConfig, stored: set[str], read, *,
                         dtype="bfloat16", mesh=None) -> VisionEncoder:
    """A VisionEncoder from checkpoint tensors: `stored` names every vision tensor there is, `read(rule)`
    returns one as stored (float32 is fine; it is cast to the parameter dtype)."""
    rules = vision_rules(vcfg)
    unknown = sorted(stored - {r.name for r in rules})
    if unknown:
        raise CheckpointError(f"{len(unknown)} vision tensors match no parameter of the vision config, "
                              f"e.g. {unknown[:5]}")
    missing = sorted(r.name for r in rules if r.name not in stored)
    if missing:
        raise CheckpointError(f"the checkpoint lacks vision tensors {missing[:5]}")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: VisionTower(vcfg, dtype=jnp.dtype(dtype))))
    targets = dict(nnx.to_flat_state(state))
    values = {}
    for rule in rules:
        target = targets[rule.path]
        array = np.asarray(read(rule), np.float32)
        if array.shape != rule.shape:
            raise CheckpointError(f"{rule.name} has shape {array.shape}, expected {rule.shape}")
        values[rule.path] = target.replace(jnp.asarray(_transform(rule, array), target.get_value().dtype))
    left = sorted(".".join(map(str, p)) for p in targets if p not in values)
    if left:
        raise AssertionError(f"the vision layout fills no value for tower parameters {left[:5]}")
    return VisionEncoder(vcfg, processor, graphdef, nnx.from_flat_state(list(values.items())), mesh)


def _place(params, mesh):
    """Each parameter with the sharding of its logical axes (the table replicates "vision")."""
    flat = []
    for path, v in nnx.to_flat_state(params):
        sharding = named_sharding(v.logical_axes, v.get_value().shape, mesh)
        flat.append((path, v.replace(jax.device_put(v.get_value(), sharding))))
    return nnx.from_flat_state(flat)


def _read(reader: SafetensorsReader, rule) -> np.ndarray:
    dtype, _ = reader.info(rule.name)
    if dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"{rule.name} has dtype {dtype}, expected a float type")
    return reader.read(rule.name)


def _transform(rule, array: np.ndarray) -> np.ndarray:
    if rule.transform == "linear":  # [out, in] -> [in, out]
        return array.T
    if rule.transform == "patch":  # [D, 3, p, p] -> [3*p*p, D]
        return array.reshape(array.shape[0], -1).T
    return array
