"""VisionEncoder: a loaded vision tower with its image-processor config; images -> text-width embeddings.

`load_vision_encoder` fills the tower from the checkpoint's `vision_tower.*` / `mm_projector.*`
tensors (layout in `convert.vision_layout`), or from a converted directory's vision item. A checkpoint
without them, or a text-only config, gives None: the text model loads as before.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.hf_params import HfParams
from convert.orbax_params import OrbaxParams, is_converted
from k3jax.config import K3Config
from k3jax.placement import place_params
from k3jax.vision.config import DEFAULT_MAX_PIXELS, ImageProcessorConfig, VisionConfig, vision_config
from k3jax.vision.preprocess import PreparedImage, prepare
from k3jax.vision.tower import VisionTower, patch_bucket, patch_layout


@functools.partial(jax.jit, static_argnums=0)
def _encode(graphdef, params, pixel_values, layout):
    """One program per patch bucket (k3jax/vision/tower.py), whatever the image's grid."""
    return nnx.merge(graphdef, params)(pixel_values, layout)


class VisionEncoder:
    """The tower's parameters (`params`), its config and the image-processor config."""

    def __init__(self, cfg: VisionConfig, processor: ImageProcessorConfig, graphdef, params, mesh=None):
        self.config, self.processor = cfg, processor
        self.graphdef = graphdef
        self.params = params if mesh is None else place_params(params, mesh)  # "vision" replicates

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
        n = image.num_patches
        rows = patch_bucket(n)
        pixels = np.zeros((rows, *image.pixel_values.shape[1:]), np.float32)
        pixels[:n] = image.pixel_values
        layout = patch_layout(self.config, tuple(map(int, image.grid_hw)), rows)
        out = _encode(self.graphdef, self.params, jnp.asarray(pixels), jax.tree.map(jnp.asarray, layout))
        return np.asarray(out[:n // (self.config.merge_kernel[0] * self.config.merge_kernel[1])], np.float32)


def load_vision_encoder(path: str | os.PathLike, cfg: K3Config, *, dtype="bfloat16", mesh=None,
                        max_pixels: int = DEFAULT_MAX_PIXELS, source=None) -> VisionEncoder | None:
    """The vision encoder of the checkpoint at `path` (safetensors or converted), or None when it
    has no vision tower. `source`: the HfParams / OrbaxParams a caller already opened on `path`."""
    if source is None:
        source = OrbaxParams(path, cfg) if is_converted(path) else HfParams(path, cfg)
    arrays = source.vision()
    if not arrays:
        return None
    processor = ImageProcessorConfig.from_pretrained(path, max_pixels=max_pixels)
    return encoder_from_arrays(vision_config(cfg), processor, arrays, dtype=dtype, mesh=mesh)


def encoder_from_arrays(vcfg: VisionConfig, processor: ImageProcessorConfig, arrays: dict, *, dtype="bfloat16",
                        mesh=None) -> VisionEncoder:
    """A VisionEncoder from the tower's parameters by path (`convert.vision_layout.vision_arrays`),
    cast to `dtype`."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: VisionTower(vcfg, dtype=jnp.dtype(dtype))))
    targets = dict(nnx.to_flat_state(state))
    if set(arrays) != set(targets):
        raise AssertionError(f"the vision layout and the tower disagree on {sorted(set(arrays) ^ set(targets))[:5]}")
    values = [(p, t.replace(jnp.asarray(arrays[p], t.get_value().dtype))) for p, t in targets.items()]
    return VisionEncoder(vcfg, processor, graphdef, nnx.from_flat_state(values), mesh)
