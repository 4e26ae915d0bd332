"""The routed experts' forward and backward in training (k3jax.train) on this machine: the "dense"
strategy training uses (every token through every expert, gated) against "ragged_dot", the
differentiable grouped matmul it replaced, on one k3-tiny MoE layer's shapes at the training batch.

    python -m benchmarks.train_moe [--repeats 7]

Both compute the same gradients (tests/pallas_kernels/test_moe.py); XLA:CPU lowers ragged_dot to a
masked product of every (token, slot) row against every expert, so its cost grows with the pool.
Medians of interleaved runs (benchmarks.timing.median_us).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import report
from benchmarks.timing import median_us
from k3jax.layers.ffn import gated_activation
from k3jax.presets import PRESETS
from k3jax.train.target import TrainOptions, training_config
from pallas_kernels.moe import xla


def gradient_fn(strategy: str, activation):
    def loss(x, weights, w_gate, w_up, w_down, ids, probe):
        out = xla.moe_ffn(x, ids, weights, w_gate, w_up, w_down, activation=activation, strategy=strategy)
        return jnp.sum(probe * out)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    cfg = training_config(PRESETS["k3-tiny"])
    options = TrainOptions()
    tokens, experts, k = options.batch * options.length, cfg.num_experts, cfg.num_experts_per_token
    width, hidden = cfg.moe_input_size, cfg.moe_intermediate_size
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((tokens, width)), jnp.float32)
    ids = jnp.asarray(np.argsort(rng.random((tokens, experts)), axis=1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.uniform(0, 1, (tokens, k)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((experts, hidden, width)) / width ** 0.5, jnp.float32)
                    for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((experts, width, hidden)) / hidden ** 0.5, jnp.float32)
    probe = jnp.asarray(rng.standard_normal((tokens, width)), jnp.float32)
    strategies = ("dense", "ragged_dot")
    fns = [gradient_fn(s, gated_activation(cfg)) for s in strategies]
    times = median_us(fns, (x, weights, w_gate, w_up, w_down, ids, probe), repeats=args.repeats)
    rows = [{"strategy": s, "forward_backward_ms": t / 1e3, "vs_dense": t / times[0]}
            for s, t in zip(strategies, times)]
    report("train_moe", rows, note=f"k3-tiny MoE layer, {tokens} tokens x top-{k} of {experts} experts "
                                   f"({hidden} x {width}), fp32, medians of {args.repeats} interleaved runs")


if __name__ == "__main__":
    main()
