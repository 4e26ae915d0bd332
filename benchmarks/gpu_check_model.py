"""The whole model on a GPU with every op on its Pallas kernel (K3JAX_KERNELS=pallas) against the XLA
paths (K3JAX_KERNELS=xla), through the engine's paged steps.

    python -m benchmarks.gpu_check_model

The model is one device's slice of K3 at TP8 (12 KDA heads of 128, 12 MLA heads with K3's widths,
hidden 7168, MXFP4 LatentMoE) cut to 4 layers (dense + KDA, KDA, KDA, MLA) and 32 experts, in bf16.
ROWS prompts of PROMPT tokens are prefilled in one step, then DECODE steps run teacher-forced (both
paths fed the XLA path's greedy tokens, so a near-tie flip cannot make them diverge). Reports the
logits' relative error per step kind, greedy agreement, and the step times side by side.
"""

from __future__ import annotations

import copy
import functools
import os
import time

import jax
import numpy as np

from benchmarks.report import report
from benchmarks.timing import relative_error
from k3jax.config import K3Config
from k3jax.decoder import PagedState, init_pools
from k3jax.model import K3Model
from k3jax.presets import PRESETS
from pallas_kernels import dispatch

ROWS, PROMPT, DECODE, PAGE = 32, 512, 16, 64
TOLERANCE = 0.05  # bf16 activations through 4 layers, summed in other orders on the two paths


def config() -> K3Config:
    hf = copy.deepcopy(PRESETS["kimi-k3"])
    text = hf["text_config"]
    text.update(num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=12, intermediate_size=4224,
                num_experts=32, attn_res_block_size=2)
    text["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=12)
    return K3Config.from_hf_dict(hf)


def make_step():
    """A fresh jit, traced under whatever K3JAX_KERNELS holds at its first call."""
    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def step(structure, params, pools, tokens, lengths, offsets, slots, table):
        logits, state = structure.merge(params)(tokens, lengths, PagedState(pools, offsets, slots, table),
                                                last_only=True)
        return logits, state.layers
    return step


def run(impl: str, model, steps, feed=None):
    """Prefill + DECODE steps with K3JAX_KERNELS=impl through steps = (prefill, decode) jitted steps.
    Returns (logits per step, times per step kind)."""
    os.environ[dispatch.ENV] = impl
    cfg = model.config
    pages_per_row = -(-(PROMPT + DECODE) // PAGE)
    pools = init_pools(cfg, num_slots=ROWS + 1, num_pages=ROWS * pages_per_row + 1, page_size=PAGE, dtype=model.dtype)
    table = 1 + np.arange(ROWS * pages_per_row, dtype=np.int32).reshape(ROWS, pages_per_row)
    slots = np.arange(1, ROWS + 1, dtype=np.int32)
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (ROWS, PROMPT), dtype=np.int32)
    prefill, decode = steps
    all_logits, times = [], {"prefill": [], "decode": []}
    tokens, lengths, offsets = prompts, np.full(ROWS, PROMPT, np.int32), np.zeros(ROWS, np.int32)
    for i in range(DECODE + 1):
        fn, kind = (prefill, "prefill") if i == 0 else (decode, "decode")
        start = time.perf_counter()
        logits, pools = jax.block_until_ready(fn(model.structure, model.params, pools, tokens, lengths, offsets,
                                                 slots, table))
        times[kind].append(time.perf_counter() - start)
        all_logits.append(np.asarray(logits, np.float32))
        offsets = offsets + lengths
        lengths = np.ones(ROWS, np.int32)
        tokens = (all_logits[-1] if feed is None else feed[i]).argmax(-1).astype(np.int32)[:, None]
    return all_logits, times


def main() -> None:
    if jax.default_backend() != "gpu":
        print(f"gpu_check_model needs a GPU (backend: {jax.default_backend()}); tests/k3jax/test_paged_decode.py "
              "runs the same comparison in interpret mode")
        return
    model = K3Model.random(config(), dtype="bfloat16", seed=0)
    steps = {impl: (make_step(), make_step()) for impl in ("xla", "pallas")}
    xla_logits, _ = run("xla", model, steps["xla"])  # the first runs compile
    pallas_logits, _ = run("pallas", model, steps["pallas"], feed=xla_logits)
    _, xla_times = run("xla", model, steps["xla"], feed=xla_logits)
    _, pallas_times = run("pallas", model, steps["pallas"], feed=xla_logits)
    rows = []
    for kind, steps in (("prefill", slice(0, 1)), ("decode", slice(1, None))):
        error = max(relative_error(p, x) for p, x in zip(pallas_logits[steps], xla_logits[steps]))
        agree = np.mean([np.mean(p.argmax(-1) == x.argmax(-1))
                         for p, x in zip(pallas_logits[steps], xla_logits[steps])])
        pallas_ms, xla_ms = (1e3 * float(np.median(t[kind])) for t in (pallas_times, xla_times))
        rows.append({"step": kind, "rows": ROWS, "tokens": PROMPT if kind == "prefill" else 1,
                     "pallas_ms": pallas_ms, "xla_ms": xla_ms, "pallas/xla": pallas_ms / xla_ms,
                     "logits_rel_err": error, "greedy_agree": float(agree)})
        assert error < TOLERANCE, f"{kind}: Pallas and XLA logits differ by {error:.3g} of the largest"
    report("gpu_check_model", rows, note=f"K3 TP8 slice, 4 layers, 32 experts, bf16; page {PAGE}; "
                                         "decode teacher-forced on the XLA run's greedy tokens")


if __name__ == "__main__":
    main()
