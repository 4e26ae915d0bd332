"""Training the target model (k3-tiny with every K3 feature) in fp32 on the chat corpus.

The experts train as dense fp32 arrays (the training config drops `quantization_config`) and are
quantized to MXFP4 at export (`k3jax.train.export`). The MoE path is differentiable inside
`k3jax.layers.ffn.training_moe` (every token through every expert, gated), which also reports each
MoE layer's expert load: the router's correction bias follows DeepSeek-V3's auxiliary-loss-free
balancing (`noaux_tc`), raised by BIAS_RATE for experts below the mean load and lowered for those
above after every step, while the router's weights learn from the loss through the gate weights.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from convert.hf_params import HfParams
from convert.mxfp4 import dequantize
from k3jax.config import K3Config
from k3jax.decoder import K3Transformer
from k3jax.layers.ffn import training_moe
from k3jax.model import K3Model

BIAS = "e_score_correction_bias"


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    steps: int = 400
    batch: int = 4
    length: int = 1024  # tokens a row predicts: most conversations fit whole (their median is 558)
    lr: float = 4e-3
    warmup: int = 10
    weight_decay: float = 0.01
    bias_rate: float = 2e-3  # the router correction bias's step (DeepSeek-V3 uses 1e-3 over far more steps)
    seed: int = 0


def training_config(hf: dict) -> K3Config:
    """`hf` (a K3 config.json) with plain expert weights: MXFP4 has no gradient, so the experts
    train dense and are quantized at export."""
    hf = copy.deepcopy(hf)
    hf.get("text_config", hf).pop("quantization_config", None)
    return K3Config.from_hf_dict(hf)


def pretrained(path: str, cfg: K3Config) -> tuple[nnx.GraphDef, nnx.State]:
    """The checkpoint at `path` as the fp32 (graphdef, params) of its training config `cfg`
    (`training_config`), to train further: MXFP4 experts decoded to plain arrays (exact: every MXFP4
    value is an fp32 one)."""
    source = HfParams(path, K3Config.from_pretrained(path))
    loaded = source.model()
    for i in range(cfg.num_hidden_layers):
        loaded.update({("layers", i) + k: v for k, v in source.layer(i).items()})
    graphdef, state = nnx.split(nnx.eval_shape(lambda: K3Transformer(cfg, dtype=jnp.float32)))

    def value(path, target):
        array = loaded[path] if path in loaded else dequantize(loaded[(*path, "packed")], loaded[(*path, "scales")])
        return target.replace(jnp.asarray(array, target.get_value().dtype))

    return graphdef, nnx.from_flat_state([(k, value(k, v)) for k, v in nnx.to_flat_state(state)])


def optimizer(options: TrainOptions, params) -> optax.GradientTransformation:
    """AdamW with warm-up and cosine decay, gradients clipped to norm 1; the router biases are
    left out (`balance_routers` moves them)."""
    warmup = min(options.warmup, options.steps // 2)  # a short run (tests) still decays
    schedule = optax.warmup_cosine_decay_schedule(0.0, options.lr, warmup, options.steps, options.lr / 10)
    trainable = nnx.from_flat_state([(k, v.replace(k[-1] != BIAS)) for k, v in nnx.to_flat_state(params)])
    return optax.masked(optax.chain(optax.clip_by_global_norm(1.0),
                                    optax.adamw(schedule, weight_decay=options.weight_decay)), trainable)


def next_token_loss(graphdef, params, tokens, weights):
    """Cross-entropy of tokens[:, 1:] given tokens[:, :-1], averaged with `weights` [B, T - 1], and
    the expert load of every MoE layer, int32 [moe layers, E] (in layer order)."""
    with training_moe() as loads:
        logits = nnx.merge(graphdef, params).forward(tokens[:, :-1]).logits
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    return jnp.sum(weights * nll) / jnp.sum(weights), jnp.stack(loads)


def balance_routers(params, loads, rate: float):
    """noaux_tc's bias update: each MoE layer's bias moves by `rate` towards an even load."""
    flat = nnx.to_flat_state(params)
    biases = [i for i, (k, _) in enumerate(flat) if k[-1] == BIAS]  # layer order, as `loads`
    flat = list(flat)
    for row, i in enumerate(biases):
        key, v = flat[i]
        load = loads[row].astype(jnp.float32)
        flat[i] = (key, v.replace(v.get_value() + rate * jnp.sign(load.mean() - load)))
    return nnx.from_flat_state(flat)


def make_step(graphdef, tx: optax.GradientTransformation, bias_rate: float):
    @jax.jit
    def step(params, state, tokens, weights):
        (loss, loads), grads = jax.value_and_grad(next_token_loss, argnums=1, has_aux=True)(graphdef, params, tokens,
                                                                                             weights)
        updates, state = tx.update(grads, state, params)
        params = balance_routers(optax.apply_updates(params, updates), loads, bias_rate)
        return params, state, loss, loads

    return step


def train(cfg: K3Config, batches, options: TrainOptions, log=print) -> tuple[nnx.State, dict]:
    """Trains a fresh fp32 model of `cfg` (a `training_config`) on `batches(batch)` (rows, weights).
    Returns (params, history: per-step losses and the last steps' expert loads)."""
    model = K3Model.random(cfg, dtype="float32", seed=options.seed)
    tx = optimizer(options, model.params)
    step = make_step(model.graphdef, tx, options.bias_rate)
    params, state = model.params, tx.init(model.params)
    losses, loads = [], None
    for i in range(options.steps):
        params, state, loss, step_loads = step(params, state, *batches(options.batch))
        losses.append(float(loss))
        loads = step_loads if loads is None or i < options.steps - 20 else loads + step_loads
        if log and (i % 25 == 0 or i == options.steps - 1):
            log(f"step {i}: loss {losses[-1]:.3f}")
    return params, {"loss": losses, "expert_load": np.asarray(loads)}

