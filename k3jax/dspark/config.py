"""DSparkConfig: the K3 DSpark draft model's config.json (vLLM `K3DSparkConfig`, model_type `k3_dspark`).

A leaf module like k3jax.config (no model code), so `convert` can use it. The draft is a dense MLA
transformer (RoPE, no NoPE / output gate / q-k norm) reading the target's hidden states at
`target_layer_ids` (ARCHITECTURE.md, "DSpark draft"); its attention is k3jax.layers.mla's layer, which
reads the MLA fields below under the target config's names.

`target_hidden_tap` is k3jax's own key: which AttnRes quantity "the hidden state after layer i" is
(the checkpoint must say what it was trained on: vLLM and SGLang read it differently):
- "residual_sum" (vLLM's default): the running residual sum after the layer; for an AttnRes target
  the sum of every bank row plus the open block and the pending FFN output, i.e. the embedding plus
  every sub-layer output so far;
- "next_mixture" (SGLang's): the pre-norm AttnRes mixture the next layer's attention reads (for the
  last layer the output-side mixture).
Without AttnRes both are the plain residual stream.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, ClassVar

from k3jax.config import ConfigError, K3Config, MLASizes

# What "the hidden state after layer i" is under AttnRes (the decoder taps either, k3jax/decoder.py)
TAP_KINDS = ("residual_sum", "next_mixture")
HIDDEN_ACTS = ("silu", "situ")
# Keys of target features the draft must not have (vLLM's K3DSparkConfig rejects them).
_REJECTED_FLAGS = ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm")
_REQUIRED = ("target_layer_ids", "target_hidden_size", "markov_rank", "q_lora_rank", "hidden_size",
             "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclasses.dataclass(frozen=True)
class DSparkConfig(MLASizes):
    target_layer_ids: tuple[int, ...]  # zero-based target layers whose output hidden states are tapped
    target_hidden_size: int
    markov_rank: int
    block_size: int  # K: query rows per draft forward = drafts per step
    mask_token_id: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    vocab_size: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    hidden_act: str = "silu"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 50000.0
    logit_scale: float = 1.0  # multiplies the Markov bias
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    target_hidden_tap: str = "residual_sum"
    # Fixed for the draft (a config that sets them is refused, _REJECTED_FLAGS): plain MLA with RoPE.
    mla_use_nope: ClassVar[bool] = False
    mla_use_output_gate: ClassVar[bool] = False

    def __post_init__(self):
        _validate(self)

    @property
    def num_target_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def context_width(self) -> int:
        """Width of the concatenated target taps that context_proj reads."""
        return self.num_target_layers * self.target_hidden_size

    @property
    def confidence_width(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DSparkConfig:
        return _from_dict(d)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> DSparkConfig:
        """Reads `config.json` from a draft checkpoint directory (or the file itself)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            return _from_dict(json.load(f))

    def check_target(self, target: K3Config) -> None:
        """The draft fits this target: same vocabulary, taps of the target's width from its layers."""
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"draft vocab_size {self.vocab_size} != target vocab_size {target.vocab_size} "
                              "(the draft uses the target's embedding and LM head)")
        if self.target_hidden_size != target.hidden_size:
            raise ConfigError(f"draft target_hidden_size {self.target_hidden_size} != target hidden_size "
                              f"{target.hidden_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ConfigError(f"target_layer_ids {bad} are outside the target's layers "
                              f"0..{target.num_hidden_layers - 1}")


def _from_dict(raw: dict[str, Any]) -> DSparkConfig:
    d = dict(raw)
    for key in _REJECTED_FLAGS:
        if d.get(key):
            raise ConfigError(f"{key} is set: the K3 DSpark draft is plain MLA with RoPE (no NoPE, output gate "
                              "or q/k norm)")
    if d.get("dspark_bonus_anchor"):
        raise ConfigError("dspark_bonus_anchor=true (the K+1-row DFlash block) is not supported for K3")
    if d.get("sample_from_anchor", True) is not True:
        raise ConfigError("sample_from_anchor must be true for K3 (the anchor row is the first prediction)")
    rope_scaling = d.get("rope_scaling")
    if rope_scaling and (rope_scaling.get("rope_type") or rope_scaling.get("type")) not in (None, "default"):
        raise ConfigError(f"rope_scaling {rope_scaling} is not supported: the draft uses the default RoPE")
    for key in _REQUIRED:
        if d.get(key) is None:
            raise ConfigError(f"the draft config has no {key!r}")
    ids = d["target_layer_ids"]
    if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) for i in ids):
        raise ConfigError(f"target_layer_ids must be a non-empty list of layer indices, got {ids!r}")
    if d.get("num_target_layers") is not None and d["num_target_layers"] != len(ids):
        raise ConfigError(f"num_target_layers={d['num_target_layers']} != len(target_layer_ids)={len(ids)}")
    vocab = d["vocab_size"]
    if d.get("draft_vocab_size") is not None and d["draft_vocab_size"] != vocab:
        raise ConfigError(f"draft_vocab_size={d['draft_vocab_size']} != vocab_size={vocab}: the draft must share "
                          "the target's vocabulary")
    fields = {f.name for f in dataclasses.fields(DSparkConfig)}
    kw = {k: v for k, v in d.items() if k in fields and v is not None}
    kw["target_layer_ids"] = tuple(ids)
    kw["block_size"] = _block_size(d)
    kw["mask_token_id"] = _mask_token(d)
    return DSparkConfig(**kw)


def _block_size(d: dict) -> int:
    sizes = {k: d[k] for k in ("block_size", "dspark_block_size") if d.get(k) is not None}
    if not sizes:
        raise ConfigError("the draft config has neither block_size nor dspark_block_size")
    if len(set(sizes.values())) > 1:
        raise ConfigError(f"block_size={d['block_size']} and dspark_block_size={d['dspark_block_size']} disagree")
    return next(iter(sizes.values()))


def _mask_token(d: dict) -> int:
    """dflash_config.mask_token_id, else mask_token_id, else dspark_noise_token_id (vLLM's order)."""
    dflash = d.get("dflash_config") or {}
    for value in (dflash.get("mask_token_id"), d.get("mask_token_id"), d.get("dspark_noise_token_id")):
        if value is not None:
            return value
    raise ConfigError("the draft config names no mask token: give dflash_config.mask_token_id, mask_token_id "
                      "or dspark_noise_token_id")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate(c: DSparkConfig) -> None:
    for name in ("target_hidden_size", "markov_rank", "block_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "q_lora_rank", "vocab_size", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = getattr(c, name)
        if not _is_int(value) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={c.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if any(i < 0 for i in c.target_layer_ids):
        raise ConfigError(f"target_layer_ids {list(c.target_layer_ids)} must be zero-based layer indices")
    if not _is_int(c.mask_token_id) or not 0 <= c.mask_token_id < c.vocab_size:
        raise ConfigError(f"mask_token_id {c.mask_token_id!r} is outside the vocabulary [0, {c.vocab_size})")
    if c.target_hidden_tap not in TAP_KINDS:
        raise ConfigError(f"target_hidden_tap {c.target_hidden_tap!r} is not one of {TAP_KINDS}")
    if c.hidden_act not in HIDDEN_ACTS:
        raise ConfigError(f"hidden_act {c.hidden_act!r} is not supported (expected one of {HIDDEN_ACTS})")
