"""Checkpoint conversion and loading on a synthetic checkpoint of about 2 GB in several shards:
conversion throughput, the converter's peak RSS against the largest layer, and load time from Orbax
vs from safetensors (same run, same machine).

    python -m benchmarks.convert_throughput [--workdir DIR]
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.report import report
from convert import layout, synth
from k3jax.config import K3Config
from k3jax.presets import K3_TINY_TEXT, _k3, _k3_layer_lists

SHARD_BYTES = 400 * 10**6


def bench_config() -> dict:
    """K3's structure at widths giving a checkpoint of about 2 GB."""
    text = copy.deepcopy(K3_TINY_TEXT)
    text.update(hidden_size=1024, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                num_experts=256, num_experts_per_token=8, moe_intermediate_size=768, routed_expert_hidden_size=512,
                vocab_size=65536, attn_res_block_size=4)
    text["linear_attn_config"].update(num_heads=8, head_dim=128, **_k3_layer_lists(12, 4))
    return _k3(text, 277)


def largest_layer_bytes(cfg: K3Config) -> int:
    sizes: dict[str, int] = {}
    for name, rule in layout.all_tensors(cfg).items():
        group = name.split(".layers.")[1].split(".")[0] if ".layers." in name else name
        sizes[group] = sizes.get(group, 0) + layout.tensor_bytes(rule)
    return max(sizes.values())


# The child reports its own high-water mark: getrusage(RUSAGE_CHILDREN) would also count the pages a
# forked child shares with this (large) process before it execs.
_PEAK_RSS = "\nprint(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"


def timed_subprocess(code: str) -> tuple[float, int, list[float]]:
    """Runs `code` in a fresh interpreter; returns (wall seconds, peak RSS bytes of that process, the
    numbers it printed before the peak RSS)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code + _PEAK_RSS], check=True, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    seconds = time.perf_counter() - start
    *printed, peak_kb = done.stdout.split()
    return seconds, int(peak_kb) * 1024, [float(x) for x in printed]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="k3jax-convert-bench-")
    src, dst = os.path.join(work, "hf"), os.path.join(work, "orbax")
    hf_config = bench_config()
    cfg = synth.write_checkpoint(src, hf_config, seed=0, shard_bytes=SHARD_BYTES)
    total = layout.checkpoint_bytes(cfg)
    shards = len([f for f in os.listdir(src) if f.endswith(".safetensors")])
    # The child prints the conversion's own time first; the wall time adds interpreter and JAX start-up.
    convert_s, convert_rss, (own_s,) = timed_subprocess(
        "import time; from convert.converter import convert_checkpoint; start = time.perf_counter(); "
        f"convert_checkpoint({src!r}, {dst!r}, overwrite=True); print(time.perf_counter() - start)")
    load = "import k3jax, jax; m = k3jax.from_pretrained({!r}); jax.block_until_ready(jax.tree.leaves(m.params))"
    orbax_s, _, _ = timed_subprocess(load.format(dst))
    hf_s, _, _ = timed_subprocess(load.format(src))
    rows = [{"checkpoint_GB": total / 1e9, "shards": shards, "convert_s": convert_s,
             "convert_MB_per_s": total / own_s / 1e6, "convert_peak_rss_MB": convert_rss / 1e6,
             "largest_layer_MB": largest_layer_bytes(cfg) / 1e6, "load_orbax_s": orbax_s,
             "load_safetensors_s": hf_s}]
    report("convert_throughput", rows, note="convert_s and load times are wall times including interpreter and JAX start-up; "
           "convert_MB_per_s uses the conversion's own time")
    if not args.workdir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
