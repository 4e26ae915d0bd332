"""MoonViT: the vision tower and its projector to the text width.

patches [N, 3*14*14] -> linear patch embedding + the learnable position table resized to the grid
-> blocks (pre-norm; fused qkv with 2-D RoPE; GELU-tanh MLP) -> final norm -> 2x2 merge -> projector
-> one text-width vector per merged token. One image at a time: attention is full within an image,
computed over blocks of keys with an online softmax (`attention`), so a full-size image's 16384
patches never hold a [heads, N, N] score matrix.

Everything that depends on the image's grid (which position-table entries each patch mixes, its RoPE
angles, the order of the 2x2 merge windows) is computed on the host (`patch_layout`) and passed in as
arrays, with the patches padded to a bucket of sizes (`patch_bucket`: powers of two and 1.5 times
them), padding masked out of attention: one compiled program serves every image size of a bucket,
where a static grid compiled one per size (a server sees many sizes; each compile of the full tower
takes seconds).

Kernels are kept [in, out] (the text model keeps [out, in], for few-row products: the tower only
ever runs many rows); `k3jax.vision.weights` maps the checkpoint's `vision_tower.*` / `mm_projector.*` tensors onto them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.layers.common import param, rms_norm
from k3jax.vision.config import LAYERNORM, PATCHMERGER_V2, VisionConfig

# One logical axis for every dimension: the table (sharding.axes) replicates the tower.
_AXES = ("vision", "vision")
# Keys per attention block: an image of up to this many patches (448 x 448 px is 1024) attends in one
# block, as full attention; a full-size one (16384) in 16, with [heads, N, 1024] scores at a time.
ATTENTION_BLOCK = 1024


class BiasLinear(nnx.Module):
    """y = x @ kernel (+ bias), kernel [in, out]; fp32 accumulation, output in x's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, *, dtype, rngs):
        self.kernel = param(rngs, (in_features, out_features), _AXES, dtype)
        self.bias = param(None, (out_features,), _AXES[:1], dtype) if bias else None

    def __call__(self, x):
        y = jnp.dot(x, self.kernel[...].astype(x.dtype), preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class Norm(nnx.Module):
    """LayerNorm (weight and bias) or RMSNorm (weight), in fp32; eps None is the dtype's epsilon."""

    def __init__(self, size: int, kind: str, eps: float | None, *, dtype):
        self.weight = param(None, (size,), _AXES[:1], dtype, init="ones")
        self.bias = param(None, (size,), _AXES[:1], dtype) if kind == LAYERNORM else None
        self.eps = eps

    def __call__(self, x):
        eps = self.eps if self.eps is not None else float(jnp.finfo(x.dtype).eps)
        if self.bias is None:
            return rms_norm(x, self.weight[...], eps, x.dtype)
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
        return (normed * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype, rngs):
        d, q = cfg.hidden_size, cfg.qkv_size
        self.cfg = cfg
        self.norm0 = Norm(d, cfg.norm_type, cfg.norm_eps, dtype=dtype)
        self.norm1 = Norm(d, cfg.norm_type, cfg.norm_eps, dtype=dtype)
        self.wqkv = BiasLinear(d, 3 * q, cfg.attn_bias, dtype=dtype, rngs=rngs)
        self.wo = BiasLinear(q, d, cfg.attn_bias, dtype=dtype, rngs=rngs)
        self.fc0 = BiasLinear(d, cfg.intermediate_size, cfg.linear_bias, dtype=dtype, rngs=rngs)
        self.fc1 = BiasLinear(cfg.intermediate_size, d, cfg.linear_bias, dtype=dtype, rngs=rngs)

    def __call__(self, x_nd, cos_nr, sin_nr, valid_n, *, attention_block: int = ATTENTION_BLOCK):
        n, heads, hd = x_nd.shape[0], self.cfg.num_heads, self.cfg.head_dim
        qkv = self.wqkv(self.norm0(x_nd)).reshape(n, 3, heads, hd)
        q, k = (_rope(qkv[:, i], cos_nr, sin_nr) for i in (0, 1))
        out = attention(q, k, qkv[:, 2].astype(jnp.float32), valid_n, block_size=attention_block)
        x_nd = x_nd + self.wo(out.reshape(n, heads * hd).astype(x_nd.dtype))
        hidden = jax.nn.gelu(self.fc0(self.norm1(x_nd)).astype(jnp.float32), approximate=True)
        return x_nd + self.fc1(hidden.astype(x_nd.dtype))


def attention(q_nhd, k_nhd, v_nhd, valid_n, *, block_size: int = ATTENTION_BLOCK):
    """Softmax attention of every row over the valid keys (fp32 [N, heads, head_dim] -> the same),
    one block of `block_size` keys at a time with an online softmax (a running max and sum per query,
    the partial output rescaled as the max grows): it holds [heads, N, block] scores, not [heads, N, N]
    (16384 patches of a full-size image at K3's 12 heads: 12 GiB in fp32)."""
    n, heads, hd = q_nhd.shape
    block = min(block_size, n)
    blocks = -(-n // block)
    pad = blocks * block - n  # the last block's tail: keys masked out like the image's padding

    def split(x):
        return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(blocks, block, *x.shape[1:])

    def step(carry, kv):
        top, total, acc = carry  # running max and sum [heads, N], unnormalised output [N, heads, hd]
        k, v, ok = kv
        scores = jnp.where(ok, jnp.einsum("qhd,khd->hqk", q_nhd, k) * hd ** -0.5, -jnp.inf)
        new_top = jnp.maximum(top, scores.max(-1))
        base = jnp.where(jnp.isfinite(new_top), new_top, 0.0)  # no valid key yet: nothing to rescale
        weights = jnp.exp(scores - base[..., None])
        scale = jnp.exp(top - base)
        total = total * scale + weights.sum(-1)
        acc = acc * scale.T[..., None] + jnp.einsum("hqk,khd->qhd", weights, v)
        return (new_top, total, acc), None

    init = (jnp.full((heads, n), -jnp.inf, jnp.float32), jnp.zeros((heads, n), jnp.float32),
            jnp.zeros((n, heads, hd), jnp.float32))
    (_, total, acc), _ = jax.lax.scan(step, init, (split(k_nhd), split(v_nhd), split(valid_n)))
    return acc / total.T[..., None]


def _rope(x_nhd, cos_nr, sin_nr):
    """Rotates consecutive (even, odd) pairs of each head by the pair's angle (fp32)."""
    x = x_nhd.astype(jnp.float32).reshape(*x_nhd.shape[:-1], -1, 2)
    even, odd = x[..., 0], x[..., 1]
    cos, sin = cos_nr[:, None], sin_nr[:, None]
    return jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x_nhd.shape)


class Projector(nnx.Module):
    """patchmerger (K2.5): LayerNorm per patch, merge, Linear+bias, GELU, Linear+bias.
    patchmergerv2 (K3): merge, Linear, GELU, Linear, RMSNorm. GELU is the exact (erf) one in both."""

    def __init__(self, cfg: VisionConfig, *, dtype, rngs):
        v2 = cfg.projector_type == PATCHMERGER_V2
        m = cfg.merged_size
        self.pre_norm = None if v2 else Norm(cfg.hidden_size, LAYERNORM, 1e-5, dtype=dtype)
        self.linear_1 = BiasLinear(m, m, not v2, dtype=dtype, rngs=rngs)
        self.linear_2 = BiasLinear(m, cfg.text_hidden_size, not v2, dtype=dtype, rngs=rngs)
        self.post_norm = Norm(cfg.text_hidden_size, "rmsnorm", cfg.projector_eps, dtype=dtype) if v2 else None

    def __call__(self, windows_mkd):
        if self.pre_norm is not None:
            windows_mkd = self.pre_norm(windows_mkd)
        x = windows_mkd.reshape(windows_mkd.shape[0], -1)
        x = jax.nn.gelu(self.linear_1(x).astype(jnp.float32), approximate=False).astype(x.dtype)
        x = self.linear_2(x)
        return x if self.post_norm is None else self.post_norm(x)


class VisionTower(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        p, d = cfg.patch_size, cfg.hidden_size
        self.patch_embed = BiasLinear(3 * p * p, d, cfg.patch_embed_bias, dtype=dtype, rngs=rngs)
        self.pos_emb = param(rngs, (cfg.pos_emb_height, cfg.pos_emb_width, d), ("vision",) * 3, dtype, stddev=1.0)
        self.blocks = nnx.List([VisionBlock(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = Norm(d, cfg.norm_type, cfg.norm_eps, dtype=dtype)
        self.projector = Projector(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, pixel_values, layout: "PatchLayout", *, attention_block: int = ATTENTION_BLOCK):
        """pixel_values [N, 3, p, p]: an image's h*w patches (row-major over its grid), then padding to
        N -> [N/4, text_hidden]: its h*w/4 merged tokens in order, then padding rows. Attention runs
        over blocks of `attention_block` keys (`attention`)."""
        n = pixel_values.shape[0]
        dtype = self.patch_embed.kernel[...].dtype
        x = self.patch_embed(pixel_values.reshape(n, -1).astype(dtype))
        # the position table resampled to the grid: each patch's weighted taps of the flattened table, one
        # tap at a time (a fused [N, D] sum; gathering every tap at once would hold [N, taps, D])
        table = self.pos_emb[...].reshape(-1, self.pos_emb.shape[-1]).astype(jnp.float32)
        pos = sum(layout.pos_weight[:, t, None] * table[layout.pos_index[:, t]] for t in range(layout.pos_index.shape[1]))
        x = x + pos.astype(x.dtype)
        for block in self.blocks:
            x = block(x, layout.cos, layout.sin, layout.valid, attention_block=attention_block)
        x = self.final_norm(x)
        windows = self.cfg.merge_kernel[0] * self.cfg.merge_kernel[1]
        return self.projector(x[layout.order].reshape(n // windows, windows, x.shape[-1]))


class PatchLayout(NamedTuple):
    """An image's grid as arrays over its N (bucketed) patch rows (see the module)."""

    pos_index: np.ndarray  # int32 [N, taps]: entries of the flattened position table each patch mixes
    pos_weight: np.ndarray  # float32 [N, taps]: their weights (torch's interpolation; padding: 0)
    cos: np.ndarray  # float32 [N, head_dim / 2]: RoPE (padding: 0)
    sin: np.ndarray
    valid: np.ndarray  # bool [N]: a patch of the image, not padding
    order: np.ndarray  # int32 [N]: the patches in merge order: each 2x2 window's in (row, column) order,
    # windows row-major, then the padding


def patch_bucket(num_patches: int) -> int:
    """The padded patch count an image runs at: the smallest of 16, 24, 32, 48, 64, 96, ... that holds it."""
    size = 16
    while True:
        for bucket in (size, size * 3 // 2):
            if bucket >= num_patches:
                return bucket
        size *= 2


def patch_layout(cfg: VisionConfig, grid_hw: tuple[int, int], num_rows: int) -> PatchLayout:
    """The layout of a grid of (h, w) patches padded to num_rows (a multiple of the merge window)."""
    h, w = grid_hw
    n = h * w
    (th, tw), taps = (cfg.pos_emb_height, cfg.pos_emb_width), 2 if cfg.pos_interpolation == "bilinear" else 4
    rows_i, rows_w = _taps(interpolation_matrix(th, h, cfg.pos_interpolation), taps)  # [h, taps]
    cols_i, cols_w = _taps(interpolation_matrix(tw, w, cfg.pos_interpolation), taps)  # [w, taps]
    row, col = np.divmod(np.arange(n), w)
    index = np.zeros((num_rows, taps * taps), np.int32)
    weight = np.zeros((num_rows, taps * taps), np.float32)
    index[:n] = (rows_i[row][:, :, None] * tw + cols_i[col][:, None, :]).reshape(n, -1)
    weight[:n] = (rows_w[row][:, :, None] * cols_w[col][:, None, :]).reshape(n, -1)
    cos, sin = (np.zeros((num_rows, cfg.head_dim // 2), np.float32) for _ in range(2))
    cos[:n], sin[:n] = rope_tables(h, w, cfg.head_dim, cfg.rope_theta)
    kh, kw = cfg.merge_kernel
    windows = np.arange(n).reshape(h // kh, kh, w // kw, kw).transpose(0, 2, 1, 3).reshape(-1)
    order = np.concatenate([windows, np.arange(n, num_rows)]).astype(np.int32)
    return PatchLayout(index, weight, cos, sin, np.arange(num_rows) < n, order)


def _taps(matrix: np.ndarray, taps: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's `taps` largest-magnitude entries of an interpolation matrix (its only non-zero ones)."""
    index = np.argsort(-np.abs(matrix), axis=1, kind="stable")[:, :taps]
    return index, np.take_along_axis(matrix, index, axis=1)


def interpolation_matrix(src: int, dst: int, mode: str) -> np.ndarray:
    """float32 [dst, src]: weights of torch's 1-D resampling from src to dst points (half-pixel centres;
    bicubic is Keys' kernel with a = -0.75, taps past the edges clamped onto the edge). Equal sizes give
    the identity, as vLLM's skip of the interpolation does."""
    out = np.zeros((dst, src), np.float64)
    centre = (np.arange(dst) + 0.5) * src / dst - 0.5
    base = np.floor(centre).astype(np.int64)
    offsets = np.arange(0, 2) if mode == "bilinear" else np.arange(-1, 3)
    distance = np.abs(centre[:, None] - base[:, None] - offsets)
    if mode == "bilinear":
        weights = np.maximum(1 - distance, 0)
    else:
        a = -0.75
        near = ((a + 2) * distance - (a + 3)) * distance * distance + 1
        far = ((a * distance - 5 * a) * distance + 8 * a) * distance - 4 * a
        weights = np.where(distance <= 1, near, far)
    taps = np.clip(base[:, None] + offsets, 0, src - 1)
    np.add.at(out, (np.repeat(np.arange(dst), len(offsets)), taps.reshape(-1)), weights.reshape(-1))
    return out.astype(np.float32)


def rope_tables(h: int, w: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [h*w, head_dim/2]: pair 2i turns by column * f_i, pair 2i+1 by row * f_i,
    f_i = theta^(-4i/head_dim), patches row-major."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 4)[: head_dim // 4].astype(np.float32) / head_dim)
    rows, cols = np.divmod(np.arange(h * w, dtype=np.float32), w)
    angles = np.stack([np.outer(cols, freqs), np.outer(rows, freqs)], axis=-1).reshape(h * w, -1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
