"""Two local processes x 8 CPU devices (gloo) run one forward on a global 8x2 mesh and match the
one-device model within fp32's tolerance (tests/agreement.py), for random weights and for a synthetic
checkpoint each process loads itself (reading only the experts its devices hold)."""

import os
import subprocess
import sys

import numpy as np

import k3jax
from convert import layout, synth
from convert.vision_layout import vision_rules
from k3jax.config import K3Config
from k3jax.model import K3Model
from k3jax.vision.config import vision_config
from tests.agreement import Referee
from tests.k3jax.tiny_configs import k3_tiny_dict
from tests.processes import local_coordinator

WORKER = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np
from sharding.distributed import initialize
assert initialize(sys.argv[1], 2, int(sys.argv[2]), timeout_s=60)
import jax
from k3jax.config import K3Config
from k3jax.model import K3Model
from k3jax.vision.config import vision_config
assert len(jax.devices()) == 16 and len(jax.local_devices()) == 8
import k3jax
from convert.reader import SafetensorsReader
model = K3Model.random(K3Config.from_preset("k3-tiny"), dtype="float32", seed=0, mesh="8x2")
ids = np.random.default_rng(1).integers(0, 512, (4, 9), dtype=np.int32)
logits = model.logits(ids)
read_bytes = [0]
read = SafetensorsReader.read
def counting_read(self, name, out=None, rows=None):
    array = read(self, name, out, rows)
    read_bytes[0] += array.nbytes
    return array
SafetensorsReader.read = counting_read
loaded = k3jax.from_pretrained(sys.argv[4], dtype="float32", mesh="8x2").logits(ids)
np.save(f"{sys.argv[3]}.read{jax.process_index()}.npy", np.array(read_bytes[0]))
if jax.process_index() == 0:
    np.save(sys.argv[3], logits)
    np.save(sys.argv[3] + ".loaded.npy", loaded)
jax.distributed.shutdown()
"""


def test_two_processes_match_one(tmp_path):
    out = tmp_path / "logits.npy"
    checkpoint = tmp_path / "hf"
    cfg = synth.write_checkpoint(checkpoint, k3_tiny_dict(), seed=4)
    coordinator = local_coordinator()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, coordinator, str(i), str(out), str(checkpoint)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    # Gloo adds the shards' partial sums in another order than one process does: compare with the
    # one-device model teacher-forced, router near-ties followed (a 1-ulp tie flipped on CI: 9e-5 off).
    ids = np.random.default_rng(1).integers(0, 512, (4, 9), dtype=np.int32)
    random = Referee(K3Model.random(K3Config.from_preset("k3-tiny"), dtype="float32", seed=0))
    for row, logits in zip(ids, np.load(out)):
        random.check_logits(row, logits, what="two processes, random weights")

    # Each process read every tensor except the other process's experts (8 of the 16, one per device),
    # and the vision tower's (replicated).
    expert_bytes = sum(layout.tensor_bytes(r) for r in layout.all_tensors(cfg).values() if r.transform == "experts")
    tower_bytes = sum(layout.tensor_bytes(r) for r in vision_rules(vision_config(cfg)))
    for i in range(2):
        assert int(np.load(f"{out}.read{i}.npy")) == layout.checkpoint_bytes(cfg) - expert_bytes // 2 + tower_bytes
    loaded = Referee(k3jax.from_pretrained(checkpoint, dtype="float32"))
    for row, logits in zip(ids, np.load(f"{out}.loaded.npy")):
        loaded.check_logits(row, logits, what="two processes, loaded checkpoint")
