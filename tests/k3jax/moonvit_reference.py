"""A NumPy (float64) MoonViT written from vLLM 0.33's kimi_k25_vit.py, on checkpoint tensors by name.

It follows vLLM's operations one by one and shares no code with k3jax.vision: the patch convolution
as a sum over (channel, y, x), torch's F.interpolate of the position table evaluated point by point,
RoPE as complex multiplication of (even, odd) pairs by `freqs_cis`, attention per head, the 2x2
merge as vLLM's tpool_patch_merger, then the projector ("patchmerger" or "patchmergerv2").
"""

from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf)


def features(t: dict[str, np.ndarray], vc: dict, pixel_values: np.ndarray, grid_hw, text_eps: float = 1e-5):
    """`t`: tensors by checkpoint name; `vc`: norm_type, num_heads, interpolation, rope_theta,
    projector ("patchmerger" / "patchmergerv2"). Returns float64 [h*w/4, text_hidden]."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    h, w = grid_hw
    conv = t["vision_tower.patch_embed.proj.weight"]
    x = np.einsum("ncyx,dcyx->nd", np.asarray(pixel_values, np.float64), conv)
    x = x + t.get("vision_tower.patch_embed.proj.bias", 0.0)
    table = t["vision_tower.patch_embed.pos_emb.weight"]
    if table.shape[:2] != (h, w):  # vLLM interpolates only when the grid differs
        table = _resize_axis(_resize_axis(table, h, 0, vc["interpolation"]), w, 1, vc["interpolation"])
    x = x + table.reshape(h * w, -1)
    d = x.shape[1]
    norm = _layer_norm if vc["norm_type"] == "layernorm" else _rms_norm_machine_eps
    wqkv = t["vision_tower.encoder.blocks.0.wqkv.weight"]
    heads = vc["num_heads"]
    hd = wqkv.shape[0] // 3 // heads
    cis = _freqs_cis(h, w, hd, vc["rope_theta"])
    i = 0
    while f"vision_tower.encoder.blocks.{i}.wqkv.weight" in t:
        b = f"vision_tower.encoder.blocks.{i}."
        qkv = _linear(t, b + "wqkv", norm(t, b + "norm0", x)).reshape(h * w, 3, heads, hd)
        q, k, v = _rotate(qkv[:, 0], cis), _rotate(qkv[:, 1], cis), qkv[:, 2]
        out = np.empty_like(q)
        for head in range(heads):
            s = q[:, head] @ k[:, head].T / math.sqrt(hd)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, head]
        x = x + _linear(t, b + "wo", out.reshape(h * w, heads * hd))
        hidden = _linear(t, b + "mlp.fc0", norm(t, b + "norm1", x))
        gelu_tanh = 0.5 * hidden * (1 + np.tanh(math.sqrt(2 / math.pi) * (hidden + 0.044715 * hidden**3)))
        x = x + _linear(t, b + "mlp.fc1", gelu_tanh)
        i += 1
    x = norm(t, "vision_tower.encoder.final_layernorm", x)
    merged = x.reshape(1, h // 2, 2, w // 2, 2, d).mean(0).transpose(0, 2, 1, 3, 4).reshape(-1, 4, d)
    if vc["projector"] == "patchmerger":
        merged = _layer_norm(t, "mm_projector.pre_norm", merged)
    y = _linear(t, "mm_projector.proj.0", merged.reshape(merged.shape[0], -1))
    y = _linear(t, "mm_projector.proj.2", 0.5 * y * (1 + _erf(y / math.sqrt(2))))
    if vc["projector"] == "patchmergerv2":
        y = y / np.sqrt(np.mean(y * y, -1, keepdims=True) + text_eps) * t["mm_projector.post_norm.weight"]
    return y


def _linear(t, name, x):
    return x @ t[name + ".weight"].T + t.get(name + ".bias", 0.0)


def _layer_norm(t, name, x):
    centred = x - x.mean(-1, keepdims=True)
    return centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5) * t[name + ".weight"] + t[name + ".bias"]


def _rms_norm_machine_eps(t, name, x):
    """nn.RMSNorm(dim) without eps: the input dtype's epsilon (the tests run float32)."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + np.finfo(np.float32).eps) * t[name + ".weight"]


def _resize_axis(a, size, axis, mode):
    """torch F.interpolate(mode, align_corners=False) along one axis, one output point at a time."""
    n = a.shape[axis]
    src = np.moveaxis(a, axis, 0)
    out = []
    for i in range(size):
        c = (i + 0.5) * n / size - 0.5
        if mode == "bilinear":
            c = max(c, 0.0)  # torch clamps the linear source coordinate at 0
            i0 = int(math.floor(c))
            i1, l1 = min(i0 + 1, n - 1), c - i0
            out.append((1 - l1) * src[i0] + l1 * src[i1])
        else:
            i0, f = int(math.floor(c)), c - math.floor(c)
            taps = [min(max(i0 + j, 0), n - 1) for j in (-1, 0, 1, 2)]
            out.append(sum(_cubic(f - j) * src[tap] for j, tap in zip((-1, 0, 1, 2), taps)))
    return np.moveaxis(np.stack(out), 0, axis)


def _cubic(x, a=-0.75):
    x = abs(x)
    if x <= 1:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a if x < 2 else 0.0


def _freqs_cis(h, w, hd, theta):
    """vLLM's Rope2DPosEmbRepeated: per patch hd/2 complex rotations, alternately on x (column) and y (row)."""
    freqs = 1.0 / theta ** (np.arange(0, hd, 4)[: hd // 4] / hd)
    y, x = np.divmod(np.arange(h * w), w)
    x_cis, y_cis = np.exp(1j * np.outer(x, freqs)), np.exp(1j * np.outer(y, freqs))
    return np.stack([x_cis, y_cis], -1).reshape(h * w, hd // 2)


def _rotate(q, cis):
    """q [N, heads, hd]: consecutive pairs as complex numbers, times cis [N, hd/2] (non-neox)."""
    z = (q[..., 0::2] + 1j * q[..., 1::2]) * cis[:, None]
    return np.stack([z.real, z.imag], -1).reshape(q.shape)
