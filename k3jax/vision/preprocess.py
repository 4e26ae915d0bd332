"""Image bytes -> normalised 14-px patches and the patch grid.

Steps, as vLLM's Kimi processor and SGLang's K3 processor do them: decode with Pillow (PNG, JPEG, WebP,
GIF's first frame), resize under the patch budget with Pillow's bicubic, composite any alpha onto the
configured background after the resize (floored to integers), pad right and bottom with black to
multiples of 28 px, normalise (x / 255 - mean) / std and cut row-major into patches.

Resizing is Pillow's (the checkpoint processor's); transformers' Kimi_K25ImageProcessor resizes with
torchvision instead, which rounds one 8-bit level differently on a fraction of a percent of the pixels
of a resized image (tests/k3jax/test_vision.py measures it).
"""

from __future__ import annotations

import dataclasses
import io
import math
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

from k3jax.vision.config import ImageProcessorConfig


@dataclasses.dataclass(frozen=True)
class PreparedImage:
    pixel_values: np.ndarray  # float32 [grid_h * grid_w, 3, patch, patch], row-major over the grid
    grid_hw: tuple[int, int]  # patches down and across (both multiples of the merge kernel)
    size: tuple[int, int]  # the original (width, height), which the prompt names

    @property
    def num_patches(self) -> int:
        return self.grid_hw[0] * self.grid_hw[1]


def resized_size(width: int, height: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(width, height) after the patch budget: never upscaled, int-truncated."""
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    budget = math.sqrt(cfg.in_patch_limit / (max(1, width // p) * max(1, height // p)))
    scale = min(1.0, budget, side * p / width, side * p / height)
    return (min(max(1, int(width * scale)), side * p), min(max(1, int(height * scale)), side * p))


def padded_size(width: int, height: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(width, height) of the resized image padded to whole merged tokens."""
    w, h = resized_size(width, height, cfg)
    t = cfg.token_pixels
    return -(-w // t) * t, -(-h // t) * t


def num_image_tokens(width: int, height: int, cfg: ImageProcessorConfig) -> int:
    """Merged tokens (<|media_pad|> positions) for an image of this size: 1920x1080 -> 2691."""
    w, h = padded_size(width, height, cfg)
    return (w // cfg.token_pixels) * (h // cfg.token_pixels)


def decode_image(data: bytes, cfg: ImageProcessorConfig) -> Image.Image:
    """Pillow image from encoded bytes; the pixel limit is checked on the header, before any pixel is
    decoded. Raises ValueError for data that is not an image, is empty or truncated, or is too large."""
    try:
        with warnings.catch_warnings():  # Pillow warns past its own limit; ours is checked just below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as error:
        raise ValueError("the data is not an image Pillow can decode (PNG, JPEG, WebP, GIF)") from error
    except Image.DecompressionBombError as error:  # Pillow refuses twice its limit while opening
        raise ValueError(f"the image is over the limit of {cfg.max_pixels} pixels per image (max_pixels): "
                         f"{error}") from error
    check_pixels(image.size, cfg)
    try:
        image.seek(0)  # GIF / animated WebP: the first frame
        image.load()
    except (OSError, SyntaxError, ValueError) as error:  # Pillow's truncated or corrupt image errors
        raise ValueError(f"the image cannot be decoded: {error}") from error
    return image


def check_pixels(size: tuple[int, int], cfg: ImageProcessorConfig) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ValueError(f"the image has no pixels ({width}x{height})")
    if width * height > cfg.max_pixels:
        raise ValueError(f"the image is {width}x{height} = {width * height} pixels, over the limit of "
                         f"{cfg.max_pixels} pixels per image (max_pixels)")


def prepare(image: Image.Image | bytes, cfg: ImageProcessorConfig) -> PreparedImage:
    """Encoded bytes or a Pillow image -> PreparedImage."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        image = decode_image(bytes(image), cfg)
    check_pixels(image.size, cfg)
    has_alpha = "A" in image.getbands() or "transparency" in image.info
    image = image.convert("RGBA" if has_alpha else "RGB")
    width, height = image.size
    new_w, new_h = resized_size(width, height, cfg)
    if (new_w, new_h) != (width, height):
        image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
    rgb_hw3 = _drop_alpha(np.asarray(image), cfg.transparent_bg_config)
    pad_w, pad_h = padded_size(width, height, cfg)
    padded = np.zeros((pad_h, pad_w, 3), np.float32)
    padded[:new_h, :new_w] = rgb_hw3
    mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
    normed = (padded / np.float32(255.0) - mean) / std
    p = cfg.patch_size
    gh, gw = pad_h // p, pad_w // p
    patches = normed.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    return PreparedImage(np.ascontiguousarray(patches), (gh, gw), (width, height))


def _drop_alpha(pixels: np.ndarray, bg: dict | None) -> np.ndarray:
    """RGB float32 [H, W, 3] (integer values): RGBA composited onto `bg` and floored as SGLang's K3
    processor does; without a background config the alpha channel is dropped."""
    rgb = pixels[..., :3].astype(np.float32)
    if pixels.shape[-1] == 3 or bg is None:
        return rgb
    alpha = pixels[..., 3:4].astype(np.float32) / np.float32(255.0)
    background = _background(pixels.shape[0], pixels.shape[1], bg)
    return np.floor(np.clip(alpha * rgb + (1 - alpha) * background, 0, 255))


def _background(height: int, width: int, bg: dict) -> np.ndarray:
    pattern = bg.get("pattern", "black")
    if pattern == "chessboard":
        square = int(bg.get("chessboard_square_size", 16))
        white = float(bg.get("chessboard_white_value", 255))
        gray = float(bg.get("chessboard_gray_value", 200))
        parity = (np.arange(height)[:, None] // square + np.arange(width)[None, :] // square) % 2
        gray_parity = 1 if bg.get("chessboard_square_on_top_left", True) else 0
        return np.where(parity == gray_parity, gray, white).astype(np.float32)[..., None]
    values = {"black": 0.0, "white": 255.0, "gray": 128.0}
    if pattern not in values:
        raise ValueError(f"transparent_bg_config pattern {pattern!r} is not one of black, white, gray, chessboard")
    return np.float32(values[pattern])
