"""Compile time of the one-token decode step: the full 93-layer K3 layer pattern at tiny widths vs
a 12-layer model of the same widths. The layers run unrolled (each owns its weights: a scan over
stacked weights copied them on every step, see k3jax/decoder.py), so compile time grows with depth:
measured 4.2 s and 51 s on 2 CPU cores (12.1x), against 3.4 s and 3.9 s when the layers were scanned.

    python -m benchmarks.decode_compile_time
"""

from __future__ import annotations

import copy
import time

import jax.numpy as jnp

from benchmarks.report import report
from k3jax.config import K3Config
from k3jax.model import K3Model, _extend
from k3jax.presets import K3_TINY_TEXT, _k3, _k3_layer_lists


def k3_pattern_at_tiny_width(num_layers: int) -> K3Config:
    text = copy.deepcopy(K3_TINY_TEXT)
    text["num_hidden_layers"] = num_layers
    text["attn_res_block_size"] = 12  # K3's block size, so the bank has ceil(L / 12) rows
    text["linear_attn_config"].update(_k3_layer_lists(num_layers, 4))
    return K3Config.from_hf_dict(_k3(text, 277))


def compile_seconds(cfg: K3Config, batch: int = 4, max_len: int = 64) -> float:
    model = K3Model.random(cfg, dtype="bfloat16")
    cache = model.init_cache(batch, max_len)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    lengths = jnp.ones((batch,), jnp.int32)
    start = time.perf_counter()
    _extend.lower(model.structure, model.params, tokens, lengths, cache).compile()
    return time.perf_counter() - start


def main() -> None:
    rows = []
    for layers in (12, 93):
        cfg = k3_pattern_at_tiny_width(layers)
        rows.append({"layers": layers, "compile_s": compile_seconds(cfg)})
    rows.append({"layers": "93 / 12", "compile_s": rows[1]["compile_s"] / rows[0]["compile_s"]})
    report("decode_compile_time", rows, note="decode step, bf16, batch 4, K3 layer pattern at k3-tiny widths")


if __name__ == "__main__":
    main()
