"""The eval job on a synthetic k3-tiny checkpoint against references computed here, one request at a
time with the one-device model's full forward and plain log-softmax (tests/agreement.py's referee):
loglikelihood and is_greedy, strided perplexity, bad lines, a killed and resumed job, meshes 1x1 and
8x2, and two processes (loglikelihood and generate).

The checkpoint routes every token to the same experts by wide margins (`fixed_routing`): the job's
batches, meshes and processes add in other orders than the reference, and random routers have
near-ties that rounding flips (issue 19). Values are compared within fp32's tolerance, greedy verdicts
and tokens where the reference's margin exceeds it.

Every request is 25..32 tokens long and max_length is 32, so the job compiles one batch shape and the
reference one row shape (compiles dominate the time on CPU); the module shares one model.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import k3jax
from convert import synth
from k3jax.eval import EvalOptions, evaluate
from k3jax.eval.output import ResultsWriter
from serve.llm import load_tokenizer
from serve.sampling import SamplingParams
from sharding.mesh import make_mesh
from tests.agreement import Referee
from tests.k3jax.tiny_configs import k3_tiny_dict
from tests.processes import local_coordinator

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
    synth.write_checkpoint(checkpoint, k3_tiny_dict(), seed=3, fixed_routing=True)
    model = k3jax.from_pretrained(checkpoint, dtype="float32", mesh=make_mesh("1x1"))
    return root, checkpoint, model, load_tokenizer(str(checkpoint))


@pytest.fixture(scope="module")
def referee(setup):
    return Referee(k3jax.from_pretrained(setup[1], dtype="float32"), pad=T)


def reference_logits(referee, ids) -> np.ndarray:
    """float64 [len(ids), vocab]: the full causal forward of this one sequence."""
    return referee.run(ids).logits.astype(np.float64)


def log_softmax(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def argmax_by_a_margin(referee, tokens) -> int | None:
    """The reference's next token after `tokens` if it leads by four times the tolerance (so that every
    path picks it), else None."""
    logits = reference_logits(referee, tokens)
    top2 = np.sort(logits[-1])[-2:]
    if top2[1] - top2[0] <= 4 * 2 * referee.tol.logits * np.abs(logits).max():
        return None
    return int(np.argmax(logits[-1]))


@pytest.fixture(scope="module")
def requests(setup, referee):
    """(data file, the good requests as (id, context ids, continuation ids)); includes two greedy
    continuations, chosen where the argmax leads by a margin."""
    root, _, model, tokenizer = setup
    rng = np.random.default_rng(0)
    good, lines = [], []
    for i in range(9):
        n_ctx, n_cont = int(rng.integers(21, 28)), int(rng.integers(1, 5))
        good.append((i, rng.integers(0, 512, n_ctx).tolist(), rng.integers(0, 512, n_cont).tolist()))
    for i, n in ((9, 1), (10, 2)):  # continuations that are the model's own argmax
        continuation = []
        while len(continuation) < n:
            context, continuation = rng.integers(0, 512, 26).tolist(), []
            while len(continuation) < n and (token := argmax_by_a_margin(referee, context + continuation)) is not None:
                continuation.append(token)
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


def check_results(referee, requests, path):
    """Every result in the file is the reference's: loglikelihood within fp32's tolerance, is_greedy
    where certain (at least 80% of the continuation tokens)."""
    results = {r["id"]: r for r in records(path) if "error" not in r}
    assert sorted(results, key=str) == sorted([rid for rid, _, _ in requests[1]], key=str)
    checked = skipped = 0
    for rid, context, continuation in requests[1]:
        certificate = referee.check_loglikelihood(context, continuation, results[rid]["loglikelihood"],
                                                  results[rid]["is_greedy"], what=f"request {rid}")
        checked, skipped = checked + certificate.checked, skipped + certificate.skipped
    assert checked >= 0.8 * (checked + skipped), (checked, skipped)
    return results


def test_loglikelihood_and_is_greedy_match_the_reference(referee, requests, single):
    results = check_results(referee, requests, single)
    assert results[9]["is_greedy"] and results[10]["is_greedy"]  # argmaxes by a margin: certain
    assert [r["line"] for r in records(single)] == list(range(1, len(requests[1]) + len(BAD_LINES) + 1))


def test_bad_lines_are_reported_by_line_number_and_the_job_goes_on(requests, single, setup, referee, capsys):
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
    check_results(referee, requests, setup[0] / "stderr.jsonl")


def test_killed_and_restarted_job_writes_the_same_file(setup, requests, single, referee, monkeypatch):
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
    check_same_results(referee, requests, raw, single)  # the kept lines and the new ones, in order
    finished = raw.read_bytes()
    again = run(model, tokenizer, requests[0], raw)  # a finished file: nothing runs, nothing changes
    assert again["results"] == again["errors"] == again["steps"] == 0
    assert raw.read_bytes() == finished


def test_perplexity_matches_strided_reference(setup, referee):
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
        total, scale, n = 0.0, 0.0, len(ids)
        for t in range(1, n):
            end = T if t < T else min(T + -(-(t + 1 - T) // stride) * stride, n)
            begin = max(end - T, 0)
            logits = reference_logits(referee, ids[begin:t + 1])
            total += log_softmax(logits[-2])[ids[t]]
            scale = max(scale, np.abs(logits).max())
        assert got[name]["num_tokens"] == n - 1
        # each token's logprob within twice fp32's logits tolerance (routing is fixed: no flips)
        bound = (n - 1) * 2 * referee.tol.logits * scale
        assert abs(got[name]["loglikelihood"] - total) <= bound, (name, got[name]["loglikelihood"], total, bound)
        assert got[name]["perplexity"] == pytest.approx(np.exp(-total / (n - 1)), rel=1e-4)
    assert summary["corpus_perplexity"] == pytest.approx(
        np.exp(-sum(r["loglikelihood"] for r in got.values()) / sum(r["num_tokens"] for r in got.values())))


def check_same_results(referee, requests, actual, expected):
    """The same lines, ids and errors as `expected`; values the reference's (other partitions add in
    other orders: each file is checked against the reference, not against the other)."""
    assert [(r["id"], r["line"], r.get("error")) for r in records(actual)] == \
        [(r["id"], r["line"], r.get("error")) for r in records(expected)]
    check_results(referee, requests, actual)


def test_mesh_8x2_gives_the_results_of_1x1(setup, requests, single, referee):
    root, checkpoint, _, tokenizer = setup
    model = k3jax.from_pretrained(checkpoint, dtype="float32", mesh="8x2")
    summary = run(model, tokenizer, requests[0], root / "mesh.jsonl")
    assert summary["compiled_shapes"] == 1
    check_same_results(referee, requests, root / "mesh.jsonl", single)


# The command-line runs, all at once: the generate task in one process, and two processes (mesh 1x4: the
# data split over them, two CPU devices each) that run the loglikelihood task, then the generate task (an
# engine on each process's 1x2 mesh). Code generated at -O0 compiles in half the time or less; it changes
# results only in rounding.
CLI_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"}
TWO_PROCESS_WORKER = """
import json, sys
import jax
from sharding.distributed import initialize
initialize(sys.argv[1], 2, int(sys.argv[2]), timeout_s=60)
from k3jax.eval.__main__ import main
for argv in json.loads(sys.argv[3]):
    main(argv)
jax.distributed.shutdown()
"""


@pytest.fixture(scope="module")
def prompts(setup):
    """Greedy and seeded sampled lines, and two bad ones. Lines go to the processes in turn: process 0 runs
    both 3-token lines and process 1 both 1-token lines, so neither compiles more than one prefill and one
    decode shape."""
    root = setup[0]
    rng = np.random.default_rng(7)
    ids = [rng.integers(0, 256, n).tolist() for n in (6, 9, 7, 5)]
    lines = [{"id": "g3", "prompt_ids": ids[0], "sampling_params": {"temperature": 0, "max_tokens": 3,
                                                                    "ignore_eos": True}},
             {"id": "g1", "prompt_ids": ids[1], "sampling_params": {"temperature": 0, "max_tokens": 1}},
             {"id": "bad", "prompt_ids": [1, 2], "sampling_params": {"bogus": 1}},
             {"id": "long", "prompt_ids": [1] * T},
             {"id": "s3", "prompt_ids": ids[2], "sampling_params": {"temperature": 0.9, "top_p": 0.9, "seed": 11,
                                                                    "max_tokens": 3, "ignore_eos": True}},
             {"id": "s1", "prompt_ids": ids[3], "sampling_params": {"temperature": 1.5, "seed": 12, "max_tokens": 1}}]
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def cli_runs(setup, requests, prompts):
    """{name: (returncode, output)} of the runs: one_gen writes one_gen.jsonl; process0 and process1 write
    two.jsonl (loglikelihood) and two_gen.jsonl (generate)."""
    root, checkpoint = setup[0], str(setup[1])
    common = ["--model", checkpoint, "--batch-size", "4", "--dtype", "float32", "--max-length", str(T)]
    generate = ["--task", "generate", "--data", str(prompts), "--engine-options", '{"block_size": 8}']
    tasks = [["--data", str(requests[0]), "--out", str(root / "two.jsonl"), "--mesh", "1x4", *common],
             [*generate, "--out", str(root / "two_gen.jsonl"), "--mesh", "1x4", *common]]
    commands = {"one_gen": ["-m", "k3jax.eval", *generate, "--out", str(root / "one_gen.jsonl"), *common]}
    coordinator = local_coordinator()
    for i in range(2):
        commands[f"process{i}"] = ["-c", TWO_PROCESS_WORKER, coordinator, str(i), json.dumps(tasks)]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), **CLI_ENV}
    procs = {}
    for name, args in commands.items():  # output to files: a full pipe would stall a process and its peer
        with open(root / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    return {name: (p.wait(timeout=300), (root / f"{name}.log").read_text()) for name, p in procs.items()}


def check_generated(referee, prompts, path):
    """Each line's tokens: greedy lines the reference's argmaxes, seeded lines the engine sampler's draws
    from the reference logits (tests/agreement.py), where the margins make them certain; max_tokens
    each; the bad lines' errors."""
    got = records(path)
    assert [r["id"] for r in got] == ["g3", "g1", "bad", "long", "s3", "s1"]
    lines = [json.loads(line) for line in open(prompts)]
    for record, line in zip(got, lines):
        if "error" in record:
            continue
        params = SamplingParams(**line["sampling_params"])
        assert len(record["token_ids"]) == params.max_tokens and record["finish_reason"] == "length", record
        if params.greedy:
            referee.check_greedy(line["prompt_ids"], record["token_ids"], what=record["id"])
        else:
            referee.check_sampled(line["prompt_ids"], record["token_ids"], params, what=record["id"])
    assert "bogus" in got[2]["error"] and "max_model_len" in got[3]["error"]
    return got


def test_generate_uses_each_lines_sampling_params(setup, prompts, cli_runs, referee):
    """The command line in one process: greedy lines as full forwards pick them, seeded lines as the
    sampler draws from them, per-line max_tokens, errors."""
    returncode, output = cli_runs["one_gen"]
    assert returncode == 0, output[-3000:]
    check_generated(referee, prompts, setup[0] / "one_gen.jsonl")


def test_two_processes_give_the_results_of_one(requests, single, cli_runs, setup, referee, prompts):
    """Process 0 writes the files; each process reads every other line and reports the bad lines of its slice."""
    root = setup[0]
    for i in range(2):
        returncode, output = cli_runs[f"process{i}"]
        assert returncode == 0, output[-3000:]
        for line in range(len(requests[1]) + 1, len(requests[1]) + len(BAD_LINES) + 1):
            assert (f"line {line}: " in output) == ((line - 1) % 2 == i)
    check_same_results(referee, requests, root / "two.jsonl", single)
    # generate: each process runs its own engine (data=2) on its lines; greedy and seeded lines come out
    # as the reference gives them, in the one-process file's order
    two = check_generated(referee, prompts, root / "two_gen.jsonl")
    assert [(r["id"], r["line"], r.get("error")) for r in two] == \
        [(r["id"], r["line"], r.get("error")) for r in records(root / "one_gen.jsonl")]


def test_generate_reads_chats_with_images(setup, tmp_path):
    """`messages` lines are rendered in K3's chat format with their images expanded, as the server's
    chat endpoint does: each line's greedy tokens are those of the decoder's full forward with the
    image's pads embedded as the vision encoder's output (tests/serve/test_engine_images.py's
    reference); a file:// image reads as its data: URL does; a bad image or a path outside
    --allowed-local-media-path is that line's error, naming the part."""
    from types import SimpleNamespace

    from serve.chat.encoding import tokenize_messages
    from tests.serve.test_engine_images import noise, png_url, reference_logits

    root, _, model, tokenizer = setup
    media = tmp_path / "media"
    media.mkdir()
    noise(7).save(media / "seven.png")

    def chat(url):
        return [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]

    params = {"temperature": 0, "max_tokens": 3, "ignore_eos": True}
    lines = [{"id": "a", "messages": chat(png_url(noise(7))), "thinking": False, "sampling_params": params},
             {"id": "b", "messages": chat(png_url(noise(8))), "thinking": False, "sampling_params": params},
             {"id": "file", "messages": chat(f"file://{media / 'seven.png'}"), "thinking": False,
              "sampling_params": params},
             {"id": "bad", "messages": chat("data:image/png;base64,bm90IGFuIGltYWdl"), "sampling_params": params},
             {"id": "outside", "messages": chat(f"file://{root}/x.png"), "sampling_params": params},
             {"id": "both", "prompt": "hi", "messages": chat(png_url(noise(7))), "sampling_params": params},
             {"id": "thinking", "prompt": "hi", "thinking": False, "sampling_params": params}]
    data, out = tmp_path / "chats.jsonl", tmp_path / "out.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    evaluate(model, tokenizer, str(data), str(out),
             EvalOptions("generate", batch_size=4, max_length=128, progress=False, allowed_local_media_path=str(media)))
    got = {r["id"]: r for r in records(out)}

    shim = SimpleNamespace(model=model, engine=SimpleNamespace(tokenizer=tokenizer))
    tol = 2 * 2.0 ** -11  # twice fp32's tolerance (tests/agreement.py), relative to the largest logit
    checked = 0
    for name, seed in (("a", 7), ("b", 8)):
        prompt = tokenize_messages(tokenizer, lines[0]["messages"], thinking=False)  # its one placeholder
        ids = [*chat_ids(tokenizer, model.vision.processor, chat(png_url(noise(seed)))), *got[name]["token_ids"][:-1]]
        assert len(ids) > len(prompt) + 1  # the image took more than its placeholder
        logits = reference_logits(shim, ids, [noise(seed)])[-3:]
        for k, token in enumerate(got[name]["token_ids"]):
            second, first = np.sort(logits[k])[-2:]
            if first - second > tol * np.abs(logits).max():
                assert token == int(np.argmax(logits[k])), (name, k)
                checked += 1
    assert checked >= 4
    assert got["file"]["token_ids"] == got["a"]["token_ids"]
    assert got["bad"]["error"].startswith("messages[0].content[1]: ")
    assert "not under the allowed local media path" in got["outside"]["error"]
    assert "not prompt and messages" in got["both"]["error"]  # neither silently dropped
    assert "`thinking` applies to `messages` only" in got["thinking"]["error"]



def chat_ids(tokenizer, processor, messages) -> list[int]:
    """The prompt the engine runs for a chat with images: rendered, each placeholder expanded."""
    from serve.chat.encoding import tokenize_messages
    from serve.multimodal import chat_prompt

    return chat_prompt(tokenize_messages(tokenizer, messages, thinking=False), messages, tokenizer, processor).ids
