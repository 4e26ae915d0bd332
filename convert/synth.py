"""Synthetic checkpoints in the exact published layout (names, dtypes, shapes, MXFP4 packing,
quantization_config), with random weights at scales that keep activations O(1).

    python -m convert.synth --preset k3-tiny --out DIR [--seed 0] [--shard-bytes N]
    python -m convert.synth --preset k3-tiny-dspark --out DIR   (a DSpark draft for k3-tiny)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from convert import layout
from convert.dspark_layout import draft_tensors
from convert.vision_layout import vision_rules
from k3jax.config import K3Config, fixed_router_bias
from k3jax.dspark.config import DSparkConfig
from k3jax.vision.config import vision_config
from pallas_kernels.mxfp4_format import GROUP, random_scale_byte

_NUMPY_DTYPES = {layout.BF16: ml_dtypes.bfloat16, layout.F32: np.float32, layout.U8: np.uint8}
MAX_SYNTHETIC_BYTES = 8 * 10**9


def synthetic_tensor(name: str, rule: layout.Rule, rng: np.random.Generator) -> np.ndarray:
    shape, kind = rule.shape, rule.transform
    if rule.dtype == layout.U8:  # MXFP4: random codes, one power-of-two scale per 32 inputs
        if name.endswith("weight_packed"):
            return rng.integers(0, 256, size=shape, dtype=np.uint8)
        return np.full(shape, random_scale_byte(shape[-1] * GROUP), np.uint8)
    if name.endswith("A_log"):
        value = np.log(rng.uniform(1.0, 16.0, size=shape))
    elif name.endswith("dt_bias"):
        value = rng.uniform(-1.0, 1.0, size=shape)
    elif name.endswith("e_score_correction_bias"):
        value = 0.05 * rng.standard_normal(shape)
    elif kind == "conv":
        value = 0.5 * rng.standard_normal(shape)
    elif kind == "squeeze":  # AttnRes pseudo-query: logits of order one after the score norm
        value = shape[-1] ** -0.5 * rng.standard_normal(shape)
    elif kind == "vector" and len(shape) == 1:  # norm weights
        value = 1.0 + 0.1 * rng.standard_normal(shape)
    elif "embed_tokens" in name:
        value = rng.standard_normal(shape)
    else:  # linear [out, in] or stacked expert weights: fan-in scaled
        value = shape[-1] ** -0.5 * rng.standard_normal(shape)
    return value.astype(_NUMPY_DTYPES[rule.dtype])


def write_checkpoint(out_dir: str | os.PathLike, hf_config: dict, *, seed: int = 0,
                     shard_bytes: int | None = None, fixed_routing: bool = False) -> K3Config:
    """Writes config.json and safetensors (sharded with an index when shard_bytes is given).

    fixed_routing: the router correction biases of `k3jax.config.fixed_router_bias` (every token takes
    the same experts by wide margins), for tests that compare numeric paths by value."""
    cfg = K3Config.from_hf_dict(hf_config)
    total = layout.checkpoint_bytes(cfg)
    if total > MAX_SYNTHETIC_BYTES:
        raise ValueError(f"a synthetic checkpoint of {total / 1e9:.1f} GB is too large; the limit is "
                         f"{MAX_SYNTHETIC_BYTES / 1e9:.0f} GB")
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = ((n, synthetic_tensor(n, r, rng)) for n, r in layout.all_tensors(cfg).items())
    if fixed_routing:
        tensors = ((n, np.asarray(fixed_router_bias(t.shape[-1]), t.dtype) if n.endswith("e_score_correction_bias")
                    else t) for n, t in tensors)
    if cfg.model_type == "kimi_k3":
        tensors = itertools.chain(tensors, vision_tensors(cfg, rng).items())
    _save_shards(out_dir, tensors, shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    write_tokenizer(out_dir, cfg)
    return cfg


def write_draft_checkpoint(out_dir: str | os.PathLike, draft_config: dict, *, seed: int = 0,
                           shard_bytes: int | None = None) -> DSparkConfig:
    """A DSpark draft checkpoint: config.json and bf16 safetensors by the draft's tensor names (the
    confidence head fp32). Linears are fan-in scaled and norms near one, so the final-normed hidden
    states are O(1) like the target's; markov_w1 rows are unit normal and markov_w2 fan-in scaled, so
    the Markov bias is of the order of the base logits."""
    cfg = DSparkConfig.from_dict(draft_config)
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)

    def value(name, shape):
        if len(shape) == 1:
            v = np.zeros(shape) if name.endswith("bias") else 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "markov_head.markov_w1.weight":
            v = rng.standard_normal(shape)
        else:
            v = shape[-1] ** -0.5 * rng.standard_normal(shape)
        return v.astype(np.float32 if name.startswith("confidence_head.") else ml_dtypes.bfloat16)

    _save_shards(out_dir, ((n, value(n, t.shape)) for n, t in draft_tensors(cfg).items()), shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(draft_config, f, indent=2)
    return cfg


def _save_shards(out_dir, tensors, shard_bytes: int | None) -> None:
    """Writes (name, array) pairs as model.safetensors, or as shards of about shard_bytes with an index."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors:
        if shard_bytes and size + tensor.nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, file), metadata=metadata)
            weight_map.update({name: file for name in shard})
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def vision_tensors(cfg: K3Config, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The vision tower and projector in the published layout (`convert.vision_layout`), none for a
    config without one: linears and the patch convolution fan-in scaled, norm weights near one, biases
    small, the position table unit normal (as large as the patch embeddings it is added to)."""
    vcfg = vision_config(cfg)
    if vcfg is None:
        return {}
    out = {}
    for rule in vision_rules(vcfg):
        noise = rng.standard_normal(rule.shape)
        if rule.name.endswith("pos_emb.weight"):
            value = noise
        elif rule.name.endswith("bias"):
            value = 0.1 * noise
        elif len(rule.shape) == 1:
            value = 1.0 + 0.1 * noise
        else:
            value = noise / np.sqrt(np.prod(rule.shape[1:]))
        out[rule.name] = value.astype(_NUMPY_DTYPES[rule.dtype])
    return out


# K3's special tokens (ARCHITECTURE.md, "Tokens"), placed above the 256 byte
# tokens in K3's order: [BOS] at the first special id, <|media_pad|> at +21 (K3: 163584 / 163605).
SPECIAL_TOKENS = {0: "[BOS]", 1: "[EOT]", 2: "[EOS]", 3: "<|end_of_msg|>", 4: "<|open|>", 5: "<|close|>",
                  6: "<|sep|>", 7: "<|media_begin|>", 8: "<|media_content|>", 9: "<|media_end|>",
                  10: "<|kimi_image_placeholder|>", 21: "<|media_pad|>"}


def write_tokenizer(out_dir, cfg: K3Config) -> None:
    """A byte-level tiktoken tokenizer (`tiktoken.model`: one base64 byte and its rank per line) with
    the special tokens in `tokenizer_config.json`, as Kimi checkpoints ship them. A vocabulary too
    small for the bytes and the specials gets no tokenizer (such a model takes token ids only)."""
    import base64

    if cfg.vocab_size < 256 + max(SPECIAL_TOKENS) + 2:
        return
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as f:
        for byte in range(256):
            f.write(f"{base64.b64encode(bytes([byte])).decode()} {byte}\n")
    names = {256 + offset: name for offset, name in SPECIAL_TOKENS.items()}
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.vocab_size - 1
    names[pad] = "[PAD]"
    added = {str(i): {"content": names.get(i, f"<|reserved_token_{i}|>"), "special": True}
             for i in range(256, cfg.vocab_size)}
    config = {"tokenizer_class": "TikTokenTokenizer", "added_tokens_decoder": added,
              "bos_token": names.get(cfg.bos_token_id), "eos_token": names.get(cfg.eos_token_id),
              "pad_token": "[PAD]", "model_max_length": cfg.max_position_embeddings}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def main(argv=None) -> None:
    from k3jax.presets import DRAFT_PRESETS, DRAFT_TARGETS, PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="k3-tiny", choices=sorted(PRESETS) + sorted(DRAFT_PRESETS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-bytes", type=int, default=None)
    args = parser.parse_args(argv)
    if args.preset in DRAFT_PRESETS:
        cfg = write_draft_checkpoint(args.out, DRAFT_PRESETS[args.preset], seed=args.seed,
                                     shard_bytes=args.shard_bytes)
        cfg.check_target(K3Config.from_hf_dict(PRESETS[DRAFT_TARGETS[args.preset]]))
    else:
        write_checkpoint(args.out, PRESETS[args.preset], seed=args.seed, shard_bytes=args.shard_bytes)
    print(f"wrote a synthetic {args.preset} checkpoint to {args.out}")


if __name__ == "__main__":
    main()
