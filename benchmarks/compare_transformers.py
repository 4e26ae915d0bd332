"""k3jax against Hugging Face transformers on the same Kimi Linear weights, side by side (issue 20).

    python -m benchmarks.compare_transformers              # the full run: 16 minutes on 2 shared cores
    python -m benchmarks.compare_transformers --quick      # a small model and sizes: a 1-2 minute smoke run

The model is Kimi-Linear-shaped, fp32, about 474M parameters: hidden 1024, 8 layers in the 3:1
KDA:MLA pattern (KDA, KDA, KDA, MLA, ...), a dense first MLP, then 32 routed experts (top-4, width 512)
plus a shared expert, vocabulary 32000. transformers builds it with random weights (fixed seed) and
writes it with save_pretrained; transformers reloads it from that directory and k3jax loads the
same directory with `k3jax.LLM` (i.e. `k3jax.from_pretrained`, whose K3Model the bare steps use).

In one run:
1. fp32 logits agree (full forward of [2, 64] and 4 greedy cached steps), else the run stops;
2. the machine's memory bandwidth: a streaming read with jnp (row-sum of a 2 GiB f32 array), 7 runs
   before the timings and 7 after them, the median of all 14;
3. prefill T = 512 (batch 1; both return every position's logits), and decode after a 128-token
   prompt at batch 1, 4, 16 and 64: transformers' forward with its DynamicCache against
   K3Model.decode, one greedy token per step (argmax on the device, no host sync inside a round),
   the two engines interleaved round by round (--rounds, at least 3 for the figures; medians, and
   the min-max range);
4. k3jax's LLM.generate at batch 1 and 16: its decode phase is timed as generating 1 + 32 tokens
   minus generating 1 (the same prompts), against the bare K3Model.decode step of the same rounds;
   beside it, in the same rounds, an Engine on the same model without async scheduling (the
   figure async scheduling is measured against);
5. decode MBU = bytes the step must read (decode_step_bytes) / step time / measured bandwidth.

Results: benchmarks/results/compare_transformers.json (top-level decode_speedup_batch1,
decode_speedup_batch16, prefill_speedup, mbu_batch1, engine_vs_model_batch1, engine_vs_model_batch16),
benchmarks/results/compare_transformers.png (decode tokens/s against batch for both engines), and a row
appended to the results table in benchmarks/README.md. --quick writes elsewhere (--results-dir).

torch and transformers are never imported here: the transformers side runs in a worker process
(benchmarks/compare_transformers_torch.py) under an interpreter that has them, found as --torch-python,
else $K3JAX_TORCH_PYTHON, else this interpreter when it has torch and transformers (the `bench` extra),
else .venv/torch/bin/python (what `make bench` creates). On this project's machines the only CPU torch
wheel is torch 2.13.0+cpu for CPython 3.11 (PyPI's Linux torch is the CUDA build, GBs of NVIDIA
libraries), hence the side venv:

    python3.11 -m venv .venv/torch
    .venv/torch/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors numpy
    # elsewhere, for the CPU wheel: --index-url https://download.pytorch.org/whl/cpu for torch

Both processes use the machine's cores (torch's intra-op threads, XLA's thread pool); only one runs at
a time. benchmarks/README.md has the figures and the caveats.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "benchmarks", "compare_transformers_torch.py")
README = os.path.join(REPO, "benchmarks", "README.md")
SIDE_VENV_PYTHON = os.path.join(REPO, ".venv", "torch", "bin", "python")
NAME = "compare_transformers"
SEED = 0

_KDA, _MLA = "linear_attention", "full_attention"

# KimiLinearConfig arguments (transformers 5.23; tests/fixtures/make_kimi_linear_fixture.py has the same
# keys for its tiny oracle). q_lora_rank=None is Kimi-Linear-48B's plain q_proj.
CONFIG = dict(
    vocab_size=32000, hidden_size=1024, num_hidden_layers=8,
    layer_types=[_KDA, _KDA, _KDA, _MLA] * 2, mlp_layer_types=["dense"] + ["sparse"] * 7,
    linear_num_heads=8, linear_head_dim=128, linear_conv_kernel_dim=4,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=256,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    intermediate_size=4096,
    num_local_experts=32, num_experts_per_tok=4, n_group=1, topk_group=1, n_shared_experts=1,
    moe_intermediate_size=512, routed_scaling_factor=2.446, norm_topk_prob=True,
    hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
QUICK_CONFIG = {**CONFIG, **dict(
    vocab_size=2048, hidden_size=256, num_hidden_layers=4, layer_types=[_KDA, _KDA, _KDA, _MLA],
    mlp_layer_types=["dense"] + ["sparse"] * 3, linear_num_heads=4, linear_head_dim=64,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
)}

FULL = dict(config=CONFIG, prompt=128, prefill=512, batches=(1, 4, 16, 64), engine_batches=(1, 16), steps=16,
            engine_steps=32, bandwidth_gib=2.0)
QUICK = dict(config=QUICK_CONFIG, prompt=32, prefill=64, batches=(1, 4), engine_batches=(1, 4), steps=4,
             engine_steps=8, bandwidth_gib=0.25)
LOGITS_TOLERANCE = 1e-4  # relative (largest difference over the largest magnitude), fp32


# --------------------------------------------------------------------------------------------- torch side
def find_torch_python(explicit: str | None) -> str:
    chosen = explicit or os.environ.get("K3JAX_TORCH_PYTHON")
    if chosen:
        return os.path.abspath(chosen) if os.sep in chosen else chosen  # a path, or a name on PATH
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        return sys.executable
    if os.path.exists(SIDE_VENV_PYTHON):
        return SIDE_VENV_PYTHON
    sys.exit("compare_transformers needs a Python with torch and transformers for the reference side:\n"
             "  python3.11 -m venv .venv/torch && .venv/torch/bin/pip install torch==2.13.0 transformers==5.23.0 "
             "safetensors numpy\n(or `make bench`, which does that; or --torch-python PATH; see the module docstring)")


class TorchSide:
    """The transformers worker process: one JSON command per line, one JSON answer per line.

    `omp_wait_policy` is the worker's OMP_WAIT_POLICY ("default": unset, libgomp's own). torch's
    OpenMP threads spin at each barrier by default, and when another process holds one of the two
    cores a spinning thread waits out whole time slices for the descheduled one: a batch-1 decode
    step of this model took 0.5-1.6 s instead of about 0.07 s while one other job ran (PASSIVE:
    0.063-0.077 s, measured side by side). The benchmark's default is PASSIVE; it is recorded."""

    def __init__(self, python: str, omp_wait_policy: str = "PASSIVE"):
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
        if omp_wait_policy == "default":
            env.pop("OMP_WAIT_POLICY", None)
        else:
            env["OMP_WAIT_POLICY"] = omp_wait_policy
        self.proc = subprocess.Popen([python, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1, env=env)

    def __call__(self, op: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the transformers worker exited (code {self.proc.wait()}) during {op!r}")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise RuntimeError(f"transformers worker, {op}: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------------------------------- measurements
def measure_bandwidth(gib: float, repeats: int = 7) -> list[float]:
    """The machine's streaming-read bandwidth as XLA sees it, GB/s of each of `repeats` runs: a row-sum
    over a [N, 4096] f32 array of `gib` GiB (the read dominates: the output is 1/4096 of it)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    rows = int(gib * 2**30) // (4096 * 4)
    x = jax.jit(lambda: jnp.arange(rows * 4096, dtype=jnp.float32).reshape(rows, 4096))()
    row_sum = jax.jit(lambda a: a.sum(axis=1))
    jax.block_until_ready(row_sum(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(row_sum(x))
        times.append(time.perf_counter() - start)
    nbytes = x.nbytes
    del x
    return [nbytes / t / 1e9 for t in times]


def decode_step_bytes(model, batch: int, context: int, experts_in_use: float) -> dict:
    """The bytes one decode step of `batch` sequences must read from memory, counted on the model's own
    arrays (so dtypes and layouts are the ones that run):

    - weights, each read once per step whatever the batch: every dense weight (attention projections,
      conv and gate parameters, norms, the dense MLP, routers, shared experts, the final norm, the LM
      head); of the embedding table only the step's token rows (one per sequence); of each MoE layer's
      routed experts only those some token of the step picked: `experts_in_use` of num_experts
      (top-k at batch 1; at larger batches the union the batch's tokens pick, measured on the
      transformers side's routing of the same greedy run and averaged over layers and steps);
    - per sequence, the decode state: every KDA layer's recurrent state and conv window (read whole)
      and every MLA layer's latent-cache rows for its `context` tokens.

    Writes (the updated KDA states, one new MLA row, the logits) and activations are not counted: this
    is the floor a memory-bound step cannot go below, so MBU = this / step time / bandwidth."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from k3jax.decoder import init_cache  # noqa: PLC0415

    cfg = model.config
    embedding = dense = routed = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(model.params)):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        nbytes = leaf.size * leaf.dtype.itemsize
        if name.startswith("embed_tokens"):
            embedding += min(batch, leaf.shape[0]) * nbytes / leaf.shape[0]
        elif "/experts/" in name:
            routed += nbytes * experts_in_use / cfg.num_experts
        else:
            dense += nbytes
    state = jax.eval_shape(lambda: init_cache(cfg, batch, context, model.dtype))
    state_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(state.layers))
    return {"embedding": embedding, "dense_weights": dense, "routed_experts": routed, "state": float(state_bytes),
            "total": embedding + dense + routed + state_bytes}


class K3Decode:
    """K3Model.decode from a prepared prompt: each round decodes from a copy of the prompt's cache
    (decode donates the cache it is given; the copy is not timed)."""

    def __init__(self, model, ids, max_len: int):
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415

        self.jax, self.jnp, self.model = jax, jnp, model
        start = time.perf_counter()
        logits, self.cache = model.prefill(ids, max_len=max_len)
        self.token = jax.block_until_ready(jnp.argmax(logits[:, -1], axis=-1))
        self.prepare_s = time.perf_counter() - start

    def run(self, steps: int) -> float:
        jax, jnp = self.jax, self.jnp
        cache = jax.block_until_ready(jax.tree.map(jnp.copy, self.cache))
        token = self.token
        start = time.perf_counter()
        for _ in range(steps):
            logits, cache = self.model.decode(token, cache)
            token = jnp.argmax(logits, axis=-1)
        jax.block_until_ready(token)
        return time.perf_counter() - start


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def summary(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values)),
            "runs": [float(v) for v in values]}


# ------------------------------------------------------------------------------------------------- the run
def run(args) -> dict:
    import jax  # noqa: PLC0415

    from serve.engine import Engine  # noqa: PLC0415
    from serve.sampling import SamplingParams  # noqa: PLC0415
    import k3jax  # noqa: PLC0415

    sizes = QUICK if args.quick else FULL
    cfg, prompt_len, rounds, steps = sizes["config"], sizes["prompt"], args.rounds, sizes["steps"]
    batches, engine_batches = sizes["batches"], sizes["engine_batches"]
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    commit = git_commit()  # at the start: others may commit while the run goes on
    load_start = os.getloadavg()
    if load_start[0] > 0.5 * (os.cpu_count() or 1):
        log(f"warning: load average {load_start[0]:.1f} on {os.cpu_count()} cores before the run: other work "
            "shares the cores and the figures will be noisy (torch's threads suffer most under oversubscription)")

    torch_side = TorchSide(find_torch_python(args.torch_python), args.torch_omp_wait_policy)
    own_checkpoint = args.checkpoint is None
    checkpoint = args.checkpoint or tempfile.mkdtemp(prefix="k3jax-compare-")
    scratch = tempfile.mkdtemp(prefix="k3jax-compare-npy-")
    try:
        log(f"writing / loading the checkpoint with transformers ({checkpoint}) ...")
        setup = torch_side("setup", checkpoint=checkpoint, config=cfg, seed=SEED, threads=args.torch_threads,
                           implementations={"attn_implementation": args.torch_attn,
                                            "experts_implementation": args.torch_experts})
        log(f"  transformers {setup['transformers']}, torch {setup['torch']} (Python {setup['python']}, "
            f"{setup['threads']} threads, OMP_WAIT_POLICY {setup['omp_wait_policy']}), "
            f"{setup['params'] / 1e6:.1f}M parameters, attention "
            f"{setup['attn_implementation']}, experts {setup['experts_implementation']}; written in "
            f"{setup['write_s']:.1f} s{' (reused)' if setup['reused_checkpoint'] else ''}, loaded in {setup['load_s']:.1f} s")

        log(f"memory bandwidth (row-sum over {sizes['bandwidth_gib']} GiB f32) ...")
        bandwidth_start = measure_bandwidth(sizes["bandwidth_gib"])
        log(f"  {np.median(bandwidth_start):.1f} GB/s median, {max(bandwidth_start):.1f} best")

        max_len = prompt_len + max(steps, sizes["engine_steps"]) + 8
        start = time.perf_counter()
        llm = k3jax.LLM(checkpoint, dtype="float32", max_model_len=max(max_len, sizes["prefill"]),
                        max_num_seqs=max(engine_batches), max_num_batched_tokens=max(engine_batches) * prompt_len,
                        max_prefill_chunk=prompt_len, max_prefill_rows=max(engine_batches))
        model = llm.model
        log(f"k3jax loaded the checkpoint in {time.perf_counter() - start:.1f} s")
        sync_engine = Engine(model, dataclasses.replace(llm.engine.options, async_scheduling=False),
                             tokenizer=llm.engine.tokenizer)

        # 1. logits: a full forward and greedy cached steps
        rng = np.random.default_rng(SEED)
        vocab = cfg["vocab_size"]
        ids = rng.integers(3, vocab, (2, 64)).tolist()
        want = np.load(torch_side("logits", ids=ids, out=os.path.join(scratch, "logits.npy"))["path"])
        forward_error = relative_error(model.logits(ids), want)
        greedy_ids = rng.integers(3, vocab, (1, 32)).tolist()
        answer = torch_side("greedy", ids=greedy_ids, steps=4, out=os.path.join(scratch, "greedy.npy"))
        want = np.load(answer["path"])
        logits, cache = model.prefill(greedy_ids, max_len=40)
        got = [np.asarray(logits)[:, -1]]
        for token in np.asarray(answer["tokens"])[:, :-1].T:
            step, cache = model.decode(token, cache)
            got.append(np.asarray(step))
        decode_error = relative_error(np.stack(got, 1), want)
        log(f"logits vs transformers (fp32, relative): full forward {forward_error:.2e}, cached decode {decode_error:.2e}")
        if max(forward_error, decode_error) > LOGITS_TOLERANCE:
            raise SystemExit(f"logits disagree beyond {LOGITS_TOLERANCE:g}: the comparison would be meaningless")

        # 2. prefill
        log(f"prefill T={sizes['prefill']} ...")
        prefill_ids = rng.integers(3, vocab, (1, sizes["prefill"]))

        def k3_prefill() -> float:
            begin = time.perf_counter()
            jax.block_until_ready(model.prefill(prefill_ids, max_len=sizes["prefill"])[0])
            return time.perf_counter() - begin

        k3_prefill()
        torch_side("prefill", ids=prefill_ids.tolist())  # warm-ups (compile, allocator)
        prefill = {"k3jax": [], "transformers": []}
        for r in range(rounds):
            for engine in (("k3jax", "transformers") if r % 2 == 0 else ("transformers", "k3jax")):
                seconds = k3_prefill() if engine == "k3jax" else torch_side("prefill", ids=prefill_ids.tolist())["seconds"]
                prefill[engine].append(sizes["prefill"] / seconds)
        log(f"  tokens/s: transformers {np.median(prefill['transformers']):.1f}, k3jax {np.median(prefill['k3jax']):.1f}")

        # 3. decode at each batch (and 4. the engine at engine_batches), interleaved
        prompts = rng.integers(3, vocab, (max(batches + engine_batches), prompt_len))
        decode, engine, routing = {}, {}, {}
        for batch in batches:
            log(f"decode batch {batch} (prompt {prompt_len}, {steps} steps a round) ...")
            batch_ids = prompts[:batch]
            torch_side("prepare", ids=batch_ids.tolist())
            k3 = K3Decode(model, batch_ids, max_len)
            routing[batch] = torch_side("routing", batch=batch, steps=min(steps, 4))
            k3.run(2)
            torch_side("decode", batch=batch, steps=2)  # warm-ups
            with_engine = batch in engine_batches
            if with_engine:
                as_lists = batch_ids.tolist()

                def decode_phase(generate) -> float:
                    """Decode tokens/s: generating 1 + engine_steps tokens minus generating 1."""
                    seconds = []
                    for n in (1, 1 + sizes["engine_steps"]):
                        begin = time.perf_counter()
                        outputs = generate(as_lists, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)] * batch)
                        assert all(len(o.token_ids) == n for o in outputs)
                        seconds.append(time.perf_counter() - begin)
                    return batch * sizes["engine_steps"] / (seconds[1] - seconds[0])

                decode_phase(llm.generate), decode_phase(sync_engine.generate)  # compile this batch's steps
            runs = {"k3jax": [], "transformers": [], "engine": [], "engine_sync": []}
            for r in range(rounds):
                for name in (("k3jax", "transformers") if r % 2 == 0 else ("transformers", "k3jax")):
                    seconds = k3.run(steps) if name == "k3jax" else torch_side("decode", batch=batch, steps=steps)["seconds"]
                    runs[name].append(batch * steps / seconds)
                if with_engine:
                    for name in (("engine", "engine_sync") if r % 2 == 0 else ("engine_sync", "engine")):
                        runs[name].append(decode_phase(llm.generate if name == "engine" else sync_engine.generate))
            torch_side("drop", batch=batch)
            del k3
            decode[batch] = {"transformers": summary(runs["transformers"]), "k3jax": summary(runs["k3jax"])}
            log(f"  tokens/s: transformers {decode[batch]['transformers']['median']:.1f}, "
                f"k3jax {decode[batch]['k3jax']['median']:.1f}; experts in use per MoE layer "
                f"{routing[batch]['experts_in_use']:.1f} of {cfg['num_local_experts']}")
            if with_engine:
                bare = decode[batch]["k3jax"]["median"]
                engine[batch] = {"tokens_per_s": summary(runs["engine"]),
                                 "vs_model": float(np.median(runs["engine"])) / bare,
                                 "vs_model_per_round": [e / m for e, m in zip(runs["engine"], runs["k3jax"])],
                                 "no_async_scheduling": {"tokens_per_s": summary(runs["engine_sync"]),
                                                         "vs_model": float(np.median(runs["engine_sync"])) / bare}}
                log(f"  LLM.generate decode phase {engine[batch]['tokens_per_s']['median']:.1f} tokens/s, "
                    f"{engine[batch]['vs_model']:.2f} of the bare step (without async scheduling "
                    f"{engine[batch]['no_async_scheduling']['vs_model']:.2f})")

        # 5. MBU, against the bandwidth measured before and after the decode runs (the median of both sets:
        # a neighbour's load changes during the run)
        bandwidth_end = measure_bandwidth(sizes["bandwidth_gib"])
        bandwidth = {"array_gib": sizes["bandwidth_gib"], "method": "jnp row-sum of [N, 4096] f32, GB/s per run",
                     "start": bandwidth_start, "end": bandwidth_end,
                     "gb_per_s": float(np.median(bandwidth_start + bandwidth_end)),
                     "gb_per_s_best": float(max(bandwidth_start + bandwidth_end))}
        log(f"memory bandwidth again: {np.median(bandwidth_end):.1f} GB/s median; MBU uses "
            f"{bandwidth['gb_per_s']:.1f} (the median of both)")
        mbu = {}
        for batch in batches:
            bytes_ = decode_step_bytes(model, batch, prompt_len + steps // 2, routing[batch]["experts_in_use"])
            step_s = batch / decode[batch]["k3jax"]["median"]
            torch_step_s = batch / decode[batch]["transformers"]["median"]
            mbu[batch] = {"bytes_per_step": bytes_, "k3jax": bytes_["total"] / step_s / (bandwidth["gb_per_s"] * 1e9),
                          "transformers": bytes_["total"] / torch_step_s / (bandwidth["gb_per_s"] * 1e9),
                          "experts_in_use": routing[batch]}
    finally:
        torch_side.close()
        if own_checkpoint:
            shutil.rmtree(checkpoint, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)

    return dict(sizes={k: v for k, v in sizes.items() if k != "config"}, config=cfg, rounds=rounds, setup=setup,
                bandwidth=bandwidth, logits={"full_forward": forward_error, "cached_decode": decode_error},
                prefill={k: summary(v) for k, v in prefill.items()}, decode=decode, engine=engine, mbu=mbu,
                wall_s=time.perf_counter() - t_start, commit=commit, loadavg={"start": load_start, "end": os.getloadavg()})


# ---------------------------------------------------------------------------------------------- reporting
def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_results(result: dict, results_dir: str, quick: bool) -> dict:
    import benchmarks.report as report_mod  # noqa: PLC0415

    decode, prefill, engine, mbu = result["decode"], result["prefill"], result["engine"], result["mbu"]
    rows = [{"measure": f"prefill T={result['sizes']['prefill']}", "batch": 1,
             "transformers_tok_s": prefill["transformers"]["median"], "k3jax_tok_s": prefill["k3jax"]["median"],
             "speedup": prefill["k3jax"]["median"] / prefill["transformers"]["median"],
             "k3jax_range": f"{prefill['k3jax']['min']:.4g}-{prefill['k3jax']['max']:.4g}",
             "transformers_range": f"{prefill['transformers']['min']:.4g}-{prefill['transformers']['max']:.4g}",
             "k3jax_mbu": None}]
    for batch, d in decode.items():
        rows.append({"measure": f"decode (prompt {result['sizes']['prompt']})", "batch": batch,
                     "transformers_tok_s": d["transformers"]["median"], "k3jax_tok_s": d["k3jax"]["median"],
                     "speedup": d["k3jax"]["median"] / d["transformers"]["median"],
                     "k3jax_range": f"{d['k3jax']['min']:.4g}-{d['k3jax']['max']:.4g}",
                     "transformers_range": f"{d['transformers']['min']:.4g}-{d['transformers']['max']:.4g}",
                     "k3jax_mbu": mbu[batch]["k3jax"]})
    for batch, e in engine.items():
        rows.append({"measure": f"LLM.generate decode ({result['sizes']['engine_steps']} steps)", "batch": batch,
                     "transformers_tok_s": None, "k3jax_tok_s": e["tokens_per_s"]["median"],
                     "speedup": None,
                     "k3jax_range": f"{e['tokens_per_s']['min']:.4g}-{e['tokens_per_s']['max']:.4g}",
                     "transformers_range": None, "k3jax_mbu": None})
        sync = e["no_async_scheduling"]["tokens_per_s"]
        rows.append({"measure": "Engine.generate decode, no async scheduling", "batch": batch,
                     "transformers_tok_s": None, "k3jax_tok_s": sync["median"], "speedup": None,
                     "k3jax_range": f"{sync['min']:.4g}-{sync['max']:.4g}", "transformers_range": None,
                     "k3jax_mbu": None})
    setup = result["setup"]
    note = (f"{setup['params'] / 1e6:.0f}M Kimi Linear fp32, {result['rounds']} interleaved rounds, medians; "
            f"bandwidth {result['bandwidth']['gb_per_s']:.1f} GB/s")
    report_mod.RESULTS_DIR = results_dir
    path = report_mod.report(NAME, rows, note=note)
    headline = {
        "decode_speedup_batch1": decode[1]["k3jax"]["median"] / decode[1]["transformers"]["median"],
        "decode_speedup_batch16": (decode[16]["k3jax"]["median"] / decode[16]["transformers"]["median"]
                                   if 16 in decode else None),
        "prefill_speedup": prefill["k3jax"]["median"] / prefill["transformers"]["median"],
        "mbu_batch1": mbu[1]["k3jax"],
        "engine_vs_model_batch1": engine[1]["vs_model"] if 1 in engine else None,
        "engine_vs_model_batch16": engine[16]["vs_model"] if 16 in engine else None,
    }
    with open(path) as f:
        payload = json.load(f)
    payload["meta"].update(commit=result["commit"], cpu=cpu_name(), quick=quick, wall_s=result["wall_s"],
                           loadavg=result["loadavg"],  # 1, 5, 15 minutes, at the start and the end
                           torch=setup["torch"], transformers=setup["transformers"], torch_python=setup["python"],
                           torch_threads=setup["threads"], torch_omp_wait_policy=setup["omp_wait_policy"],
                           attn_implementation=setup["attn_implementation"],
                           experts_implementation=setup["experts_implementation"])
    detail = {k: result[k] for k in ("sizes", "config", "rounds", "bandwidth", "logits", "prefill", "decode", "engine", "mbu")}
    detail["params"] = setup["params"]
    payload = {"benchmark": payload["benchmark"], **headline, "meta": payload["meta"], "rows": payload["rows"], **detail}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print("\n" + "  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in headline.items()))
    print(f"results: {path}")
    plot(result, os.path.join(results_dir, f"{NAME}.png"), payload["meta"])
    return payload


def plot(result: dict, path: str, meta: dict) -> None:
    import matplotlib  # noqa: PLC0415
    import matplotlib.ticker  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    batches = sorted(result["decode"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, label, style in (("transformers", f"transformers {meta['transformers']} (torch eager)", "s--"),
                               ("k3jax", "k3jax K3Model.decode", "o-")):
        medians = [result["decode"][b][name]["median"] for b in batches]
        lows = [result["decode"][b][name]["min"] for b in batches]
        highs = [result["decode"][b][name]["max"] for b in batches]
        (line,) = ax.plot(batches, medians, style, label=label)
        ax.fill_between(batches, lows, highs, alpha=0.2, color=line.get_color())
    if result["engine"]:
        eb = sorted(result["engine"])
        ax.plot(eb, [result["engine"][b]["tokens_per_s"]["median"] for b in eb], "^", ms=8,
                label="k3jax LLM.generate (decode phase)")
    for b in batches:
        k3, tf = result["decode"][b]["k3jax"]["median"], result["decode"][b]["transformers"]["median"]
        ax.annotate(f"{k3 / tf:.2f}x", (b, max(k3, tf)), textcoords="offset points", xytext=(0, 8), ha="center",
                    fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.set_title(f"{result['setup']['params'] / 1e6:.0f}M Kimi Linear, fp32, prompt {result['sizes']['prompt']} "
                 f"(k3jax / transformers above each batch)\n"
                 f"{meta['cpu_count']} cores ({meta['cpu']}), {meta['date']}, {meta['commit']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


README_END = "<!-- compare_transformers: each full run adds its row above this line -->"


def readme_row(payload: dict) -> str:
    meta, decode, mbu, engine = payload["meta"], payload["decode"], payload["mbu"], payload["engine"]

    def pair(batch):
        d = decode.get(batch) or decode.get(str(batch))
        if d is None:
            return "-"
        tf, k3 = d["transformers"]["median"], d["k3jax"]["median"]
        return f"{tf:.1f} / {k3:.1f} ({k3 / tf:.2f}x)"

    def eng(batch, key=None):
        e = engine.get(batch) or engine.get(str(batch))
        e = e.get(key) if e and key else e
        return f"{e['vs_model']:.2f}" if e else "-"

    prefill = payload["prefill"]
    m1 = mbu.get(1) or mbu.get("1")
    load = meta["loadavg"]
    cells = [meta["date"], f"`{meta['commit']}`",
             f"{meta['cpu_count']} x {meta['cpu']}; load {load['start'][0]:.1f} before, {load['end'][0]:.1f} after",
             f"{payload['bandwidth']['gb_per_s']:.1f}",
             f"{prefill['transformers']['median']:.0f} / {prefill['k3jax']['median']:.0f} "
             f"({payload['prefill_speedup']:.2f}x)",
             pair(1), pair(16), f"{m1['k3jax']:.1%}",
             f"{eng(1)} / {eng(16)} (no async scheduling {eng(1, 'no_async_scheduling')} / "
             f"{eng(16, 'no_async_scheduling')})"]
    return "| " + " | ".join(cells) + " |"


def update_readme(payload: dict) -> None:
    """Appends this run's row to the results table in benchmarks/README.md (the marker ends the table)."""
    if not os.path.exists(README):
        return
    text = open(README).read()
    if README_END not in text:
        print("benchmarks/README.md has no results marker; row not added")
        return
    row = readme_row(payload)
    text = text.replace(README_END, row + "\n" + README_END)
    with open(README, "w") as f:
        f.write(text)
    print(f"README row: {row}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per measure (medians; default 3)")
    parser.add_argument("--quick", action="store_true", help="a small model and sizes: a smoke run (results to /tmp)")
    parser.add_argument("--checkpoint", help="the checkpoint directory to write (or reuse, when it holds this "
                        "config's checkpoint); default: a temporary directory, deleted afterwards")
    parser.add_argument("--torch-python", help="the interpreter with torch and transformers (see the docstring)")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--torch-omp-wait-policy", default=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                        help="OMP_WAIT_POLICY of the transformers worker: PASSIVE (default, unless the "
                        "environment sets one), ACTIVE, or 'default' for libgomp's own (TorchSide says why)")
    parser.add_argument("--torch-attn", help="transformers' attn_implementation (default: its own, sdpa)")
    parser.add_argument("--torch-experts", help="transformers' experts_implementation (default: its own, grouped_mm)")
    parser.add_argument("--results-dir", help="where the JSON and PNG go (default benchmarks/results; "
                        "with --quick a temporary directory)")
    parser.add_argument("--no-readme", action="store_true", help="do not append the run's row to benchmarks/README.md")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    results_dir = args.results_dir or (os.path.join(tempfile.gettempdir(), "k3jax-compare-quick") if args.quick
                                       else os.path.join(REPO, "benchmarks", "results"))
    result = run(args)
    payload = write_results(result, results_dir, args.quick)
    if not args.quick and not args.no_readme:
        update_readme(payload)
    print(f"wall time {result['wall_s']:.0f} s ({datetime.datetime.now():%H:%M})")


if __name__ == "__main__":
    main()
