"""Multi-host serving: two processes x 2 CPU devices (gloo) run the engine on a model=4 mesh, process 0
scheduling and sampling while process 1 follows its steps (the target's and the DSpark draft's); the
outputs are those of one process driving the same mesh over 4 local devices: the same programs, whose
collectives add in another order (gloo across processes), so both runs are checked against the
one-device model (tests/agreement.py: greedy and seeded tokens where the margins make them certain,
logprobs within fp32's tolerance). Every process generates code at -O0: compiling is most of the
test's time, and -O0 halves it."""

import json
import os
import subprocess
import sys


from convert import synth
from k3jax.presets import DRAFT_PRESETS
import k3jax
from serve.sampling import SamplingParams
from tests.agreement import Referee
from tests.k3jax.tiny_configs import k3_tiny_dict
from tests.processes import local_coordinator

SHARED = list(range(40, 60))  # two pages shared: the third request resumes from a KDA snapshot
REQUESTS = [(SHARED + [1, 2, 3], {"max_tokens": 6, "temperature": 0, "logprobs": 1}),
            (list(range(5, 12)), {"max_tokens": 6, "temperature": 0.8, "seed": 3, "logprobs": 2}),
            (SHARED + [9, 9], {"max_tokens": 5, "temperature": 0, "logprobs": 1})]

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
requests = [(prompt, SamplingParams(**params)) for prompt, params in json.loads(sys.argv[6])]
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
    requests = json.dumps(REQUESTS)
    runs = {"single": [str(tmp_path / "single.json"), "", checkpoint, draft, requests],
            "0": [str(tmp_path / "multi.json"), coordinator, checkpoint, draft, requests],
            "1": [str(tmp_path / "unused.json"), coordinator, checkpoint, draft, requests]}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, mode, *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for mode, args in runs.items()]
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
    single = json.loads((tmp_path / "single.json").read_text())
    multi = json.loads((tmp_path / "multi.json").read_text())
    for name in ("plain", "speculative"):
        assert single[f"{name}/stats"]["prefix_cache_hit_rate"] > 0  # the third request reused the first one's
    assert multi["plain/stats"]["prefix_cache_hit_rate"] == single["plain/stats"]["prefix_cache_hit_rate"]
    assert multi["speculative/stats"]["spec_num_draft_tokens"] > 0
    assert sorted(multi) == sorted(single)
    referee = Referee(k3jax.from_pretrained(checkpoint, dtype="float32"))
    for run, outputs in (("one process", single), ("two processes", multi)):
        for name in ("plain", "speculative"):
            for i, (prompt, params) in enumerate(REQUESTS):
                out, params, what = outputs[f"{name}/{i}"], SamplingParams(**params), f"{run}, {name} request {i}"
                logprobs = [{int(k): v for k, v in entry.items()} for entry in out["logprobs"]]
                if params.greedy:  # speculation and the processes change nothing beyond rounding
                    referee.check_greedy(prompt, out["tokens"], logprobs, what=what)
                elif name == "plain":  # the sampler's draw under the request's key
                    referee.check_sampled(prompt, out["tokens"], params, logprobs, what=what)
                else:  # rejection sampling draws other tokens than the plain sampler: their logprobs
                    referee.check_logprobs(prompt, out["tokens"], logprobs, what=what)
