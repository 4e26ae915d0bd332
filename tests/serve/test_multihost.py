"""Multi-host serving: two processes x 2 CPU devices (gloo) run the engine on a model=4 mesh, process 0
scheduling and sampling while process 1 follows its steps (the target's and the DSpark draft's); the
outputs equal one process driving the same mesh over 4 local devices (the same programs: the same
tokens, and logprobs to fp32 rounding). Every process generates code at -O0: compiling is most of the
test's time, and -O0 halves it."""

import json
import os
import subprocess
import sys

import numpy as np

from convert import synth
from k3jax.presets import DRAFT_PRESETS
from tests.k3jax.tiny_configs import k3_tiny_dict
from tests.processes import local_coordinator

WORKER = """
import json, os, sys
mode = sys.argv[1]
os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 --xla_force_host_platform_device_count="
                           + ("4" if mode == "single" else "2"))
import jax
if mode != "single":
    from sharding.distributed import initialize
    assert initialize(sys.argv[3], 2, int(mode), timeout_s=60)
import k3jax
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams

# Loaded across processes on a mesh with data=1: the loader's placement must reshard on the devices.
model = k3jax.from_pretrained(sys.argv[4], dtype="float32", mesh="4x1")
options = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=8, enable_prefix_caching=True)
engines = {"plain": Engine(model, EngineOptions(**options)),
           "speculative": Engine(model, EngineOptions(**options, speculative_config={
               "model": sys.argv[5], "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}))}
shared = list(range(40, 60))  # two pages shared: the third request resumes from a KDA snapshot
requests = [(shared + [1, 2, 3], SamplingParams(max_tokens=6, temperature=0)),
            (list(range(5, 12)), SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=2)),
            (shared + [9, 9], SamplingParams(max_tokens=5, temperature=0))]
outputs = {}
for name, engine in engines.items():
    if jax.process_index() != 0:
        engine.runner.follow(engine.speculator)
        continue
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[f"{name}/{i}"] = {"tokens": list(out.token_ids), "logprobs": out.logprobs}
    engine.runner.stop_followers()
    outputs[f"{name}/stats"] = engine.stats()
if jax.process_index() == 0:
    with open(sys.argv[2], "w") as f:
        json.dump(outputs, f, default=float)
if mode != "single":
    jax.distributed.shutdown()
"""


def test_two_processes_serve_like_one(tmp_path):
    """Plain and speculative engines (DSpark draft, probabilistic drafting, prefix cache) one after the other."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    checkpoint, draft = str(tmp_path / "hf"), str(tmp_path / "draft")
    synth.write_checkpoint(checkpoint, k3_tiny_dict(), seed=4)
    synth.write_draft_checkpoint(draft, DRAFT_PRESETS["k3-tiny-dspark"], seed=1)
    coordinator = local_coordinator()
    runs = {"single": [str(tmp_path / "single.json"), "", checkpoint, draft],
            "0": [str(tmp_path / "multi.json"), coordinator, checkpoint, draft],
            "1": [str(tmp_path / "unused.json"), coordinator, checkpoint, draft]}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, mode, *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for mode, args in runs.items()]
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
    single = json.loads((tmp_path / "single.json").read_text())
    multi = json.loads((tmp_path / "multi.json").read_text())
    for name in ("plain", "speculative"):
        assert single[f"{name}/stats"]["prefix_cache_hit_rate"] > 0  # the third request reused the first one's
    assert multi["plain/stats"] == single["plain/stats"]
    assert multi["speculative/stats"]["spec_num_draft_tokens"] > 0
    assert multi["speculative/stats"]["spec_num_accepted_tokens"] == single["speculative/stats"][
        "spec_num_accepted_tokens"]
    requests = [k for k in single if not k.endswith("/stats")]
    assert len(requests) == 6 and sorted(multi) == sorted(single)
    for key in requests:
        assert multi[key]["tokens"] == single[key]["tokens"], key
        # gloo adds across processes in another order than one process does: fp32 rounding, ~2e-6 relative
        for got, want in zip(multi[key]["logprobs"] or [], single[key]["logprobs"] or []):
            assert got.keys() == want.keys()
            np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-5, atol=1e-5)
    for i in (0, 2):  # greedy: speculation changes nothing
        assert single[f"speculative/{i}"]["tokens"] == single[f"plain/{i}"]["tokens"]
