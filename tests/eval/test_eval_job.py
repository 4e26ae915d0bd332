"""The eval job on a synthetic k3-tiny checkpoint against references computed here, one request at a
time with `K3Model.logits` and plain log-softmax: loglikelihood and is_greedy, strided perplexity,
bad lines, a killed and resumed job, meshes 1x1 and 8x2, and two processes.

Every request is 25..32 tokens long and max_length is 32, so the job compiles one batch shape and the
reference one row shape (compiles dominate the time on CPU); the module shares one model.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import k3jax
from convert import synth
from k3jax.eval import EvalOptions, evaluate
from k3jax.eval.output import ResultsWriter
from serve.llm import load_tokenizer
from sharding.mesh import make_mesh
from tests.k3jax.tiny_configs import k3_tiny_dict

T = 32  # max_length, and the reference's padded row length
BAD_LINES = {  # line text -> expected error substring; appended after the good requests
    "{not json": "invalid JSON",
    '{"id": "m", "context": "abc"}': "needs `context` and `continuation`",
    '{"id": "e", "context": "abc", "continuation": ""}': "empty continuation",
    json.dumps({"id": "long", "context_ids": [1] * 30, "continuation_ids": [2] * 5}): "over the maximum length 32",
    '{"id": "v", "context_ids": [1], "continuation_ids": [600]}': "outside [0, 512)",
    '{"id": 0, "context_ids": [1], "continuation_ids": [2]}': "duplicate id",
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    checkpoint = root / "k3-tiny"
    synth.write_checkpoint(checkpoint, k3_tiny_dict(), seed=3)
    model = k3jax.from_pretrained(checkpoint, dtype="float32", mesh=make_mesh("1x1"))
    return root, checkpoint, model, load_tokenizer(str(checkpoint))


def reference_logits(model, ids) -> np.ndarray:
    """float64 [len(ids), vocab]: the full causal forward of this one sequence (right-padded to T)."""
    padded = np.zeros((1, T), np.int32)
    padded[0, :len(ids)] = ids
    return model.logits(padded, lengths=[len(ids)])[0, :len(ids)].astype(np.float64)


def log_softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def reference_loglikelihood(model, context, continuation):
    logits = reference_logits(model, context + continuation)
    logp = log_softmax(logits)
    at = [len(context) - 1 + i for i in range(len(continuation))]  # position t - 1 predicts token t
    return (float(sum(logp[t, c] for t, c in zip(at, continuation))),
            all(int(np.argmax(logits[t])) == c for t, c in zip(at, continuation)))


@pytest.fixture(scope="module")
def requests(setup):
    """(data file, the good requests as (id, context ids, continuation ids)); includes two greedy continuations."""
    root, _, model, tokenizer = setup
    rng = np.random.default_rng(0)
    good, lines = [], []
    for i in range(9):
        n_ctx, n_cont = int(rng.integers(21, 28)), int(rng.integers(1, 5))
        good.append((i, rng.integers(0, 512, n_ctx).tolist(), rng.integers(0, 512, n_cont).tolist()))
    for i, n in ((9, 1), (10, 2)):  # continuations that are the model's own argmax
        context = rng.integers(0, 512, 26).tolist()
        continuation = []
        for _ in range(n):
            continuation.append(int(np.argmax(reference_logits(model, context + continuation)[-1])))
        good.append((i, context, continuation))
    lines = [json.dumps({"id": i, "context_ids": c, "continuation_ids": x}) for i, c, x in good]
    text = {"id": "text", "context": "The quick brown fox jumps ", "continuation": "over"}
    lines.append(json.dumps(text))
    good.append(("text", tokenizer.encode("The quick brown fox jumps"), tokenizer.encode(" over")))
    lines += list(BAD_LINES)
    path = root / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, good


def run(model, tokenizer, data, out, **options):
    return evaluate(model, tokenizer, str(data), str(out), EvalOptions(max_length=T, batch_size=4, **options))


def records(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def single(setup, requests):
    root, _, model, tokenizer = setup
    out = root / "single.jsonl"
    run(model, tokenizer, requests[0], out)
    return out


def test_loglikelihood_and_is_greedy_match_the_reference(setup, requests, single):
    _, _, model, tokenizer = setup
    results = {r["id"]: r for r in records(single) if "error" not in r}
    assert len(results) == len(requests[1])
    for rid, context, continuation in requests[1]:
        want, greedy = reference_loglikelihood(model, context, continuation)
        assert results[rid]["loglikelihood"] == pytest.approx(want, rel=1e-5, abs=1e-4), rid
        assert results[rid]["is_greedy"] == greedy, rid
    assert results[9]["is_greedy"] and results[10]["is_greedy"]
    assert [r["line"] for r in records(single)] == list(range(1, len(requests[1]) + len(BAD_LINES) + 1))


def test_bad_lines_are_reported_by_line_number_and_the_job_goes_on(requests, single, setup, capsys):
    _, _, model, tokenizer = setup
    first_bad = len(requests[1]) + 1
    errors = [r for r in records(single) if "error" in r]
    assert [r["line"] for r in errors] == list(range(first_bad, first_bad + len(BAD_LINES)))
    for record, expected in zip(errors, BAD_LINES.values()):
        assert expected in record["error"], record
    # stderr names the same lines (a fresh output file: the errors are new there)
    summary = run(model, tokenizer, requests[0], setup[0] / "stderr.jsonl", sort=False)
    err = capsys.readouterr().err
    for line, expected in zip(range(first_bad, first_bad + len(BAD_LINES)), BAD_LINES.values()):
        assert f"line {line}: " in err and expected in err
    assert summary["errors"] == len(BAD_LINES) and summary["results"] == len(requests[1])
    # input-order batching changes the batches, not the file's order or (beyond rounding) its values
    unsorted = records(setup[0] / "stderr.jsonl")
    assert [(r["id"], r["line"]) for r in unsorted] == [(r["id"], r["line"]) for r in records(single)]
    for a, b in zip(unsorted, records(single)):
        assert a.get("loglikelihood", 0) == pytest.approx(b.get("loglikelihood", 0), rel=1e-5, abs=1e-4)


def test_killed_and_restarted_job_writes_the_same_file(setup, requests, single, monkeypatch):
    root, _, model, tokenizer = setup
    raw = root / "killed.jsonl"
    with monkeypatch.context() as m:  # the file as the job streams it, before the final sort
        m.setattr(ResultsWriter, "finalize", lambda self: self.close() or 0)
        run(model, tokenizer, requests[0], raw)
    data = raw.read_bytes()
    cut = data.index(b"\n", len(data) // 2) - 5  # mid-line: a partial last line
    raw.write_bytes(data[:cut])
    summary = run(model, tokenizer, requests[0], raw)
    assert 0 < summary["results"] < len(requests[1])  # resumed, not redone
    assert raw.read_bytes() == single.read_bytes()
    again = run(model, tokenizer, requests[0], raw)  # a finished file: nothing runs, nothing changes
    assert again["results"] == again["errors"] == again["steps"] == 0
    assert raw.read_bytes() == single.read_bytes()


def test_perplexity_matches_strided_reference(setup):
    root, _, model, tokenizer = setup
    rng = np.random.default_rng(5)
    docs = {"long": rng.integers(0, 512, 71).tolist(), "short": rng.integers(0, 512, 27).tolist()}
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": k, "ids": v}) + "\n" for k, v in docs.items())
                    + json.dumps({"id": "text", "text": "Call me Ishmael. Some years ago, never mind"}) + "\n")
    docs["text"] = [model.config.bos_token_id] + tokenizer.encode("Call me Ishmael. Some years ago, never mind")
    stride = 12
    summary = run(model, tokenizer, path, root / "ppl.jsonl", task="perplexity", stride=stride)
    got = {r["id"]: r for r in records(root / "ppl.jsonl")}
    for name, ids in docs.items():
        # token t is scored in the first window ending at or after t + 1 (ends T, T + stride, ... capped
        # at the length), with the window's tokens before it as context
        total, n = 0.0, len(ids)
        for t in range(1, n):
            end = T if t < T else min(T + -(-(t + 1 - T) // stride) * stride, n)
            begin = max(end - T, 0)
            total += log_softmax(reference_logits(model, ids[begin:t + 1])[-2])[ids[t]]
        assert got[name]["num_tokens"] == n - 1
        assert got[name]["loglikelihood"] == pytest.approx(total, rel=1e-5, abs=1e-4), name
        assert got[name]["perplexity"] == pytest.approx(np.exp(-total / (n - 1)), rel=1e-4)
    assert summary["corpus_perplexity"] == pytest.approx(
        np.exp(-sum(r["loglikelihood"] for r in got.values()) / sum(r["num_tokens"] for r in got.values())))


def check_same_results(actual, expected):
    actual, expected = records(actual), records(expected)
    assert [(r["id"], r["line"], r.get("error"), r.get("is_greedy")) for r in actual] == \
        [(r["id"], r["line"], r.get("error"), r.get("is_greedy")) for r in expected]
    for a, b in zip(actual, expected):  # same program on other partitions: rounding differs
        assert a.get("loglikelihood", 0) == pytest.approx(b.get("loglikelihood", 0), rel=1e-5, abs=1e-4)


def test_mesh_8x2_gives_the_results_of_1x1(setup, requests, single):
    root, checkpoint, _, tokenizer = setup
    model = k3jax.from_pretrained(checkpoint, dtype="float32", mesh="8x2")
    summary = run(model, tokenizer, requests[0], root / "mesh.jsonl")
    assert summary["compiled_shapes"] == 1
    check_same_results(root / "mesh.jsonl", single)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_results_of_one(setup, requests, single):
    """Two local processes of one CPU device each (mesh 1x2: data split over the processes), through the
    command line; each reads every other line, process 0 writes the file."""
    root, checkpoint, _, _ = setup
    out = root / "two.jsonl"
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    cmd = [sys.executable, "-m", "k3jax.eval", "--model", str(checkpoint), "--data", str(requests[0]), "--out",
           str(out), "--mesh", "1x2", "--batch-size", "4", "--dtype", "float32", "--max-length", str(T),
           "--coordinator", coordinator, "--num-processes", "2"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    check_same_results(out, single)
    # each process reported the bad lines of its own slice
    first_bad = len(requests[1]) + 1
    for i, (_, err) in enumerate(results):
        for line in range(first_bad, first_bad + len(BAD_LINES)):
            assert (f"line {line}: " in err) == ((line - 1) % 2 == i)


def test_generate_uses_each_lines_sampling_params(setup):
    root, _, model, _ = setup
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, 6).tolist(), rng.integers(0, 256, 9).tolist()]
    lines = [{"id": "g3", "prompt_ids": prompts[0], "sampling_params": {"temperature": 0, "max_tokens": 3,
                                                                          "ignore_eos": True}},
             {"id": "g1", "prompt_ids": prompts[1], "sampling_params": {"temperature": 0, "max_tokens": 1}},
             {"id": "bad", "prompt_ids": [1, 2], "sampling_params": {"bogus": 1}},
             {"id": "long", "prompt_ids": [1] * T}]
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run(model, None, path, root / "gen.jsonl", task="generate", engine_options={"block_size": 8})
    got = records(root / "gen.jsonl")
    assert [r["line"] for r in got] == [1, 2, 3, 4]
    for record, prompt, n in zip(got, prompts, (3, 1)):
        tokens = list(prompt)
        for _ in range(n):  # greedy by full forwards
            tokens.append(int(np.argmax(reference_logits(model, tokens)[-1])))
        assert record["token_ids"] == tokens[len(prompt):] and record["finish_reason"] == "length"
    assert "bogus" in got[2]["error"] and "max_model_len" in got[3]["error"]
