"""An independent NumPy (float64) forward of the DSpark draft over contiguous arrays: the test oracle.

It reads the draft's parameters by name from the flat nnx state (kernels turned [in, out]) and writes the
math out plainly: RoPE as a complex rotation of adjacent pairs, naive MLA with per-head keys and
values expanded from the latent, full softmax over every context position plus the whole block.
"""

import numpy as np
from flax import nnx


def params_of(draft) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(draft, nnx.Param))
    params = {".".join(map(str, path)): np.asarray(v.get_value(), np.float64) for path, v in flat}
    return {name: value.T if name.endswith(".kernel") else value for name, value in params.items()}


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    """x [T, ..., D] rotated at positions [T]: pair (x[2i], x[2i+1]) as a complex number times e^(i*pos*f_i)."""
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2) / d)
    angle = np.asarray(positions, np.float64).reshape((-1,) + (1,) * (x.ndim - 1)) * freq
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def context_kv(p, cfg, taps, positions):
    """Per draft layer, the cache rows [T, latent + rope] of context taps [T, F] at positions [T]."""
    c = rms(taps @ p["context_proj.kernel"], p["context_norm.weight"], cfg.rms_norm_eps)
    return [_kv_rows(p, cfg, l, c, positions) for l in range(cfg.num_hidden_layers)]


def _kv_rows(p, cfg, l, x, positions):
    r = cfg.kv_lora_rank
    kv = x @ p[f"layers.{l}.self_attn.kv_a_proj_with_mqa.kernel"]
    latent = rms(kv[:, :r], p[f"layers.{l}.self_attn.kv_a_layernorm.weight"], cfg.rms_norm_eps)
    return np.concatenate([latent, rope(kv[:, r:], positions, cfg.rope_theta)], axis=-1)


def block_logits(p, cfg, head, context, bonus, position):
    """Base logits [K, V] of the block [bonus, mask x (K-1)] at position.., attending to context (per
    layer rows of positions < position) and the whole block; and each layer's cache rows of the block."""
    k, r, heads, nope = cfg.block_size, cfg.kv_lora_rank, cfg.num_attention_heads, cfg.qk_nope_head_dim
    embed, lm_head, logit_scale = head
    positions = position + np.arange(k)
    x = np.asarray(embed, np.float64)[[bonus] + [cfg.mask_token_id] * (k - 1)]
    block_rows = []
    for l in range(cfg.num_hidden_layers):
        a = f"layers.{l}.self_attn."
        h = rms(x, p[f"layers.{l}.input_layernorm.weight"], cfg.rms_norm_eps)
        q = rms(h @ p[a + "q_a_proj.kernel"], p[a + "q_a_layernorm.weight"], cfg.rms_norm_eps) @ p[a + "q_b_proj.kernel"]
        q = q.reshape(k, heads, cfg.qk_head_dim)
        q = np.concatenate([q[..., :nope], rope(q[..., nope:], positions, cfg.rope_theta)], axis=-1)
        block_rows.append(_kv_rows(p, cfg, l, h, positions))
        rows = np.concatenate([context[l], block_rows[-1]])  # [S, C]
        up = (rows[:, :r] @ p[a + "kv_b_proj.kernel"]).reshape(len(rows), heads, nope + cfg.v_head_dim)
        keys = np.concatenate([up[..., :nope], np.repeat(rows[:, None, r:], heads, axis=1)], axis=-1)
        scores = np.einsum("thd,shd->hts", q, keys) * cfg.qk_head_dim ** -0.5
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out = np.einsum("hts,shv->thv", weights, up[..., nope:]).reshape(k, -1)
        x = x + out @ p[a + "o_proj.kernel"]
        h = rms(x, p[f"layers.{l}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate, up_ = h @ p[f"layers.{l}.mlp.gate_proj.kernel"], h @ p[f"layers.{l}.mlp.up_proj.kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * up_) @ p[f"layers.{l}.mlp.down_proj.kernel"]
    h = rms(x, p["final_norm.weight"], cfg.rms_norm_eps)
    return h @ np.asarray(lm_head, np.float64).T * logit_scale, block_rows  # lm_head [V, H]


def markov_greedy(base, bonus, w1, w2, scale):
    """The left-to-right Markov loop: base [K, V] -> (drafts [K], biased logits [K, V])."""
    prev, drafts, logits = bonus, [], []
    for j in range(base.shape[0]):
        z = base[j] + scale * (w2 @ w1[prev])
        prev = int(np.argmax(z))
        drafts.append(prev)
        logits.append(z)
    return np.array(drafts), np.stack(logits)
