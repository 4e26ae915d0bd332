"""Vision tower and image-processor configurations, read from a checkpoint's config (leaf module).

Two tower variants exist, chosen by keys of `vision_config` as vLLM 0.33's `kimi_k25_vit.py` chooses
them:
- K2.5: LayerNorm (eps 1e-5) with biases everywhere, bicubic position-table interpolation, the
  "patchmerger" projector (LayerNorm before the merge, biased linears);
- K3: RMSNorm without biases, bilinear interpolation, qkv width 1536 != hidden 1024, the
  "patchmergerv2" projector (bias-free linears, RMSNorm after).
A key that is absent takes the default of the family the outer config names (`kimi_k3` -> K3,
anything else -> K2.5), so a K3 checkpoint that writes only the sizes still gets RMSNorm.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from k3jax.config import ConfigError, K3Config

LAYERNORM, RMSNORM = "layernorm", "rmsnorm"
PATCHMERGER, PATCHMERGER_V2 = "patchmerger", "patchmergerv2"
_ONLY = {"pos_emb_type": ("divided_fixed",), "merge_type": ("sd2_tpool",), "mlp_type": ("mlp2",),
         "activation_func": ("gelu_pytorch_tanh",), "hidden_act": ("gelu_pytorch_tanh",)}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    hidden_size: int = 1024
    num_layers: int = 27
    num_heads: int = 12
    qkv_size: int = 1536  # heads x head dim; K2.5 has none (equal to hidden_size)
    intermediate_size: int = 4096
    patch_size: int = 14
    merge_kernel: tuple[int, int] = (2, 2)
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    norm_type: str = RMSNORM
    # None: the activation dtype's machine epsilon, which PyTorch's nn.RMSNorm() uses when built
    # without one (as K3's vision norms are): 2^-7 in bf16, not a small constant.
    norm_eps: float | None = None
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_bias: bool = False
    pos_interpolation: str = "bilinear"
    rope_theta: float = 10000.0
    projector_type: str = PATCHMERGER_V2
    projector_eps: float = 1e-5
    text_hidden_size: int = 7168

    def __post_init__(self):
        if self.qkv_size % self.num_heads or (self.qkv_size // self.num_heads) % 4:
            raise ConfigError(f"vision qkv width {self.qkv_size} must split into {self.num_heads} heads whose "
                              "width is a multiple of 4 (2-D RoPE rotates pairs alternately on x and y)")
        if self.norm_type not in (LAYERNORM, RMSNORM):
            raise ConfigError(f"vision norm_type {self.norm_type!r} is not supported (layernorm or rmsnorm)")
        if self.pos_interpolation not in ("bilinear", "bicubic"):
            raise ConfigError(f"pos_emb_interpolation_mode {self.pos_interpolation!r} is not supported")
        if self.projector_type not in (PATCHMERGER, PATCHMERGER_V2):
            raise ConfigError(f"mm_projector_type {self.projector_type!r} is not supported")

    @property
    def head_dim(self) -> int:
        return self.qkv_size // self.num_heads

    @property
    def merged_size(self) -> int:
        """Width of one merged token: the merge window's patches side by side."""
        return self.hidden_size * self.merge_kernel[0] * self.merge_kernel[1]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, k3: bool, text_hidden_size: int) -> "VisionConfig":
        """`d` is the checkpoint's `vision_config`; `k3` picks the family defaults (module docstring)."""
        def get(*keys, default):
            for key in keys:
                if d.get(key) is not None:
                    return d[key]
            return default

        for key, supported in _ONLY.items():  # the forms vLLM implements; it raises on the others too
            if d.get(key) is not None and d[key] not in supported:
                raise ConfigError(f"vision_config.{key} {d[key]!r} is not supported (only {', '.join(supported)})")
        hidden = int(get("vt_hidden_size", "hidden_size", default=1024 if k3 else 1152))
        merge = get("merge_kernel_size", default=(2, 2))
        norm_type = get("norm_type", default=RMSNORM if k3 else LAYERNORM)
        return cls(
            hidden_size=hidden,
            num_layers=int(get("vt_num_hidden_layers", "num_hidden_layers", default=27)),
            num_heads=int(get("vt_num_attention_heads", "num_attention_heads", default=12 if k3 else 16)),
            qkv_size=int(get("qkv_hidden_size", default=1536 if k3 else hidden)),
            intermediate_size=int(get("vt_intermediate_size", "intermediate_size", default=4096 if k3 else 4304)),
            patch_size=int(get("patch_size", default=14)),
            merge_kernel=(int(merge[0]), int(merge[1])),
            # Older checkpoints and K3 write init_pos_emb_*, transformers' K2.5 config pos_emb_*.
            pos_emb_height=int(get("init_pos_emb_height", "pos_emb_height", default=64)),
            pos_emb_width=int(get("init_pos_emb_width", "pos_emb_width", default=64)),
            norm_type=norm_type,
            # vLLM builds nn.RMSNorm / nn.LayerNorm without an eps: dtype epsilon / 1e-5.
            norm_eps=None if norm_type == RMSNORM else 1e-5,
            attn_bias=bool(get("attn_bias", default=not k3)),
            linear_bias=bool(get("linear_bias", default=not k3)),
            patch_embed_bias=bool(get("patch_embed_proj_bias", default=not k3)),
            pos_interpolation=get("pos_emb_interpolation_mode", default="bilinear" if k3 else "bicubic"),
            rope_theta=float((d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            projector_type=get("mm_projector_type", default=PATCHMERGER_V2 if k3 else PATCHMERGER),
            projector_eps=float(get("projector_ln_eps", "projection_layer_norm_eps", default=1e-5)),
            text_hidden_size=text_hidden_size,
        )


def vision_config(cfg: K3Config) -> VisionConfig | None:
    """The tower config of a text config that carries one (K3's wrapper), else None."""
    if cfg.vision_config is None:
        return None
    return VisionConfig.from_hf_dict(cfg.vision_config, k3=cfg.model_type == "kimi_k3",
                                     text_hidden_size=cfg.hidden_size)


# K2.5's processor defaults (transformers' Kimi_K25ImageProcessor), which vLLM also assumes.
_PROCESSOR_DEFAULTS = {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16384,
                       "patch_limit_on_one_side": 512, "image_mean": (0.5, 0.5, 0.5),
                       "image_std": (0.5, 0.5, 0.5), "transparent_bg_config": None}
DEFAULT_MAX_PIXELS = 50_000_000  # a 50 MP image already decodes to 150 MB of RGB


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """The checkpoint's `media_proc_cfg` (preprocessor_config.json) plus the decoder's pixel limit."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # None: alpha is dropped; else {"pattern": "black" | "white" | "gray" | "chessboard", ...}
    transparent_bg_config: dict | None = dataclasses.field(default=None, compare=False, hash=False)
    max_pixels: int = DEFAULT_MAX_PIXELS  # decompression-bomb guard, checked before decoding

    @property
    def token_pixels(self) -> int:
        """Side in pixels of the square one merged token covers (28)."""
        return self.patch_size * self.merge_kernel_size

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, max_pixels: int = DEFAULT_MAX_PIXELS) -> "ImageProcessorConfig":
        """`d` is preprocessor_config.json: its `media_proc_cfg` when it has one, else the keys at top level."""
        d = d.get("media_proc_cfg", d)
        if d.get("fixed_output_tokens") is not None:
            raise ConfigError("media_proc_cfg.fixed_output_tokens is not supported (the token count would "
                              "not follow the image grid)")
        kw = {k: d.get(k) if d.get(k) is not None else v for k, v in _PROCESSOR_DEFAULTS.items()}
        merge = kw["merge_kernel_size"]
        kw["merge_kernel_size"] = int(merge[0] if isinstance(merge, (list, tuple)) else merge)
        kw["image_mean"], kw["image_std"] = tuple(map(float, kw["image_mean"])), tuple(map(float, kw["image_std"]))
        return cls(**kw, max_pixels=max_pixels)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *,
                        max_pixels: int = DEFAULT_MAX_PIXELS) -> "ImageProcessorConfig":
        """From `path`/preprocessor_config.json, or K2.5's defaults when the checkpoint has none."""
        file = os.path.join(os.fspath(path), "preprocessor_config.json")
        if not os.path.exists(file):
            return cls(max_pixels=max_pixels)
        with open(file) as f:
            return cls.from_dict(json.load(f), max_pixels=max_pixels)
