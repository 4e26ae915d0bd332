"""The transformers side of benchmarks/compare_transformers.py: a worker process that owns the torch model.

It needs only torch, transformers, safetensors and numpy (no jax, no k3jax), so it runs under any
interpreter that has them: the k3jax venv with the `bench` extra, or the side Python 3.11 venv that
`make bench` creates with the on-disk torch 2.13.0+cpu wheel (benchmarks/README.md says why).
compare_transformers.py starts it and sends one JSON command per line on stdin; it answers one JSON
line per command on its own stdout (anything else that writes to fd 1, transformers' warnings
included, is sent to stderr). Large arrays travel as .npy files.

It builds KimiLinearForCausalLM from CONFIG (random weights, fixed seed), saves it with
save_pretrained, reloads it from disk with transformers' default implementations (what a user gets:
sdpa attention where it can, its default experts implementation; the ones chosen are reported), and
runs it in eager mode under torch.inference_mode() with transformers' own cache (DynamicCache).
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time

import numpy as np
import torch
import transformers
from transformers import KimiLinearConfig, KimiLinearForCausalLM
from transformers.models.kimi_linear import modeling_kimi_linear as mkl

STAMP = "compare_transformers.json"  # written beside the checkpoint: what made it (reused when equal)


@torch.no_grad()
def reinit_(model, seed: int) -> None:
    """Every weight random and O(1)-preserving, as tests/fixtures/make_kimi_linear_fixture.py does:
    linear N(0, 1/fan_in), embedding N(0, 1), norms 1 + 0.1 N, router N(0, 1/hidden) with a 0.1 N
    correction bias (so routing is not uniform by construction), FLA's A_log / dt_bias ranges."""
    g = torch.Generator().manual_seed(seed)

    def normal_(t, std, mean=0.0):
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32) * std + mean)

    done = set()
    for name, mod in model.named_modules():
        p = name + "." if name else ""
        if isinstance(mod, torch.nn.Embedding):
            normal_(mod.weight, 1.0)
        elif isinstance(mod, torch.nn.Linear):
            normal_(mod.weight, 1.0 / math.sqrt(mod.in_features))
        elif isinstance(mod, torch.nn.Conv1d):
            normal_(mod.weight, 1.0 / math.sqrt(mod.kernel_size[0]))
        elif isinstance(mod, (mkl.KimiLinearRMSNorm, mkl.KimiLinearRMSNormGated)):
            normal_(mod.weight, 0.1, mean=1.0)
        elif isinstance(mod, mkl.KimiLinearExperts):
            normal_(mod.gate_up_proj, 1.0 / math.sqrt(mod.gate_up_proj.shape[-1]))
            normal_(mod.down_proj, 1.0 / math.sqrt(mod.down_proj.shape[-1]))
            done.update({p + "gate_up_proj", p + "down_proj"})
            continue
        elif isinstance(mod, mkl.KimiLinearTopkRouter):
            normal_(mod.weight, 1.0 / math.sqrt(mod.weight.shape[-1]))
            normal_(mod.e_score_correction_bias, 0.1)
            done.update({p + "weight", p + "e_score_correction_bias"})
            continue
        elif isinstance(mod, mkl.KimiLinearForgetGate):
            mod.A_log.copy_(torch.rand(mod.A_log.shape, generator=g) * 15.0 + 1.0).log_()
            dt = (torch.rand(mod.dt_bias.shape, generator=g) * (math.log(1e-1) - math.log(1e-3))
                  + math.log(1e-3)).exp().clamp_min(1e-4)
            mod.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            done.update({p + "A_log", p + "dt_bias"})
            continue
        else:
            continue
        done.add(p + "weight")
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    missing = sorted(set(named) - done)
    assert not missing, f"not re-initialised: {missing}"


class Worker:
    def __init__(self):
        self.model = None
        self.prepared = {}  # batch -> (cache after the prompt, first decode token)

    def setup(self, checkpoint: str, config: dict, seed: int, threads: int | None = None,
              implementations: dict | None = None) -> dict:
        """Writes the checkpoint (unless `checkpoint` already holds this config's), then loads it.
        `implementations`: attn_implementation / experts_implementation for from_pretrained (None:
        transformers' defaults)."""
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        stamp = {"config": config, "seed": seed, "transformers": transformers.__version__}
        stamp_path = os.path.join(checkpoint, STAMP)
        reused = os.path.exists(stamp_path) and json.load(open(stamp_path)) == stamp
        write_s = 0.0
        if not reused:
            start = time.perf_counter()
            cfg = KimiLinearConfig(**config)
            model = KimiLinearForCausalLM(cfg).eval()
            reinit_(model, seed)
            os.makedirs(checkpoint, exist_ok=True)
            model.save_pretrained(checkpoint, safe_serialization=True)
            with open(stamp_path, "w") as f:
                json.dump(stamp, f)
            del model
            write_s = time.perf_counter() - start
        start = time.perf_counter()
        self.model = KimiLinearForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, **{k: v for k, v in (implementations or {}).items() if v}).eval()
        load_s = time.perf_counter() - start
        cfg = self.model.config
        return {"reused_checkpoint": reused, "write_s": write_s, "load_s": load_s,
                "params": sum(p.numel() for p in self.model.parameters()),
                "attn_implementation": cfg._attn_implementation,
                "experts_implementation": getattr(cfg, "_experts_implementation", None),
                "torch": torch.__version__, "transformers": transformers.__version__,
                "python": sys.version.split()[0], "threads": torch.get_num_threads(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default")}

    @torch.inference_mode()
    def logits(self, ids: list, out: str) -> dict:
        """Full causal forward without a cache (float32 [B, T, vocab]) to `out` (.npy)."""
        np.save(out, self.model(input_ids=torch.tensor(ids), use_cache=False).logits.float().numpy())
        return {"path": out}

    @torch.inference_mode()
    def greedy(self, ids: list, steps: int, out: str) -> dict:
        """Prefill with the cache, then `steps` - 1 greedy decode steps: the logits that chose each of
        the `steps` tokens ([B, steps, vocab] to `out`) and the tokens."""
        result = self.model(input_ids=torch.tensor(ids), use_cache=True)
        cache, logits = result.past_key_values, [result.logits[:, -1]]
        for _ in range(steps - 1):
            token = logits[-1].argmax(-1, keepdim=True)
            result = self.model(input_ids=token, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            logits.append(result.logits[:, -1])
        stacked = torch.stack(logits, 1)
        np.save(out, stacked.float().numpy())
        return {"path": out, "tokens": stacked.argmax(-1).tolist()}

    @torch.inference_mode()
    def prefill(self, ids: list) -> dict:
        """One timed prefill (every position's logits, as K3Model.prefill returns them) with a fresh cache."""
        tokens = torch.tensor(ids)
        start = time.perf_counter()
        self.model(input_ids=tokens, use_cache=True)
        return {"seconds": time.perf_counter() - start}

    @torch.inference_mode()
    def prepare(self, ids: list) -> dict:
        """Runs the prompt once and keeps its cache and first greedy token for `decode` to start from."""
        tokens = torch.tensor(ids)
        start = time.perf_counter()
        result = self.model(input_ids=tokens, use_cache=True)
        seconds = time.perf_counter() - start
        self.prepared[tokens.shape[0]] = (result.past_key_values, result.logits[:, -1].argmax(-1, keepdim=True))
        return {"seconds": seconds}

    @torch.inference_mode()
    def decode(self, batch: int, steps: int) -> dict:
        """`steps` greedy decode steps from a copy of the prepared cache (the copy is not timed)."""
        cache, token = self.prepared[batch]
        cache = copy.deepcopy(cache)
        start = time.perf_counter()
        for _ in range(steps):
            result = self.model(input_ids=token, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            token = result.logits[:, -1].argmax(-1, keepdim=True)
        return {"seconds": time.perf_counter() - start}

    @torch.inference_mode()
    def routing(self, batch: int, steps: int) -> dict:
        """The routed experts the decode steps use: per MoE layer and step, how many distinct experts
        the batch's tokens pick (the union), averaged; from the same greedy run as `decode` (untimed)."""
        cache, token = self.prepared[batch]
        cache = copy.deepcopy(cache)
        picked = []  # per router call (one per MoE layer and step): distinct experts over the batch
        hooks = [m.register_forward_hook(lambda mod, args, out: picked.append(out[2].unique().numel()))
                 for m in self.model.modules() if isinstance(m, mkl.KimiLinearTopkRouter)]
        try:
            for _ in range(steps):
                result = self.model(input_ids=token, past_key_values=cache, use_cache=True)
                cache = result.past_key_values
                token = result.logits[:, -1].argmax(-1, keepdim=True)
        finally:
            for hook in hooks:
                hook.remove()
        return {"experts_in_use": float(np.mean(picked)), "min": int(min(picked)), "max": int(max(picked))}

    def drop(self, batch: int) -> dict:
        self.prepared.pop(batch, None)
        return {}


def main() -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's channel
    os.dup2(2, 1)  # everything else that prints goes to stderr
    sys.stdout = sys.stderr
    worker = Worker()
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            break
        try:
            answer = {"ok": True, **getattr(worker, op)(**command)}
        except Exception as error:  # reported to the caller, which stops the run
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
