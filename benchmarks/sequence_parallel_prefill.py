"""Sequence-parallel prefill: tokens/s against the number of sequence shards, on fake CPU devices.

    python -m benchmarks.sequence_parallel_prefill [--tokens 2048] [--repeats 5]

k3-tiny, fp32, one prompt, fixed routing. `K3Model.prefill` on one device, then
`K3Model.prefill_sequence_parallel` on meshes of 1 x n (no tensor parallelism, the prompt over n
`data` shards) for n = 1, 2, 4, 8. Each split run's logits are checked against the unsplit ones
first; the runs are interleaved and each figure is the median of the repeats.

What fake devices on 2 cores can show: XLA:CPU runs each fake device's program on its own thread,
all on the same 2 cores. Two shards can use both cores where the plain prefill's one device mostly
uses one, so they may beat it; beyond 2 the figures measure what splitting costs on top of the same
arithmetic (the KDA summary run over [v | 0], twice the state width; the gathers of the MLA rows;
the shard_map boundaries; per-device program overhead). They cannot show the speedup or the memory
of n real devices, where each holds T / n tokens of activations and does about 1 / n of the work
(MLA's causal attention less evenly: the last shard attends to the most keys).
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402

from benchmarks.report import report  # noqa: E402
from benchmarks.timing import median_us, relative_error  # noqa: E402
from k3jax.config import K3Config  # noqa: E402
from k3jax.model import K3Model  # noqa: E402

SHARDS = (1, 2, 4, 8)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    cfg = K3Config.from_preset("k3-tiny")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.tokens), dtype=np.int32)
    plain = K3Model.random(cfg, dtype="float32", seed=0).with_fixed_routing()
    want = np.asarray(plain.prefill(ids)[0])
    runs = [("plain, 1 device", 1, lambda: plain.prefill(ids))]  # (what, shards, run)
    for n in SHARDS:
        model = K3Model.random(cfg, dtype="float32", seed=0, mesh=f"1x{n}").with_fixed_routing()
        error = relative_error(model.prefill_sequence_parallel(ids)[0], want)
        assert error < 2e-4, f"{n} shards: logits off by {error:.1e} of the largest"
        runs.append((f"split, mesh 1x{n}", n, lambda model=model: model.prefill_sequence_parallel(ids)))
    times = median_us([run for _, _, run in runs], (), args.repeats)
    rows = [{"prefill": what, "shards": n, "tokens_per_shard": -(-args.tokens // n), "ms": us / 1e3,
             "tokens_per_s": args.tokens / (us / 1e6), "vs_plain": times[0] / us}
            for (what, n, _), us in zip(runs, times)]
    report("sequence_parallel_prefill", rows,
           note=f"k3-tiny fp32, 1 prompt of {args.tokens} tokens, median of {args.repeats}, "
                f"{jax.default_backend()} with {len(jax.devices())} fake devices on {os.cpu_count()} cores: "
                "n shards share 2 cores: beyond 2, the split's overhead, not n devices' speedup")


if __name__ == "__main__":
    main()
