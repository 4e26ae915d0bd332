"""Speculative decoding in the engine (fp32, greedy): whatever the drafts, the tokens are the
reference's greedy tokens (tests/agreement.py: teacher-forced, within fp32's tolerance), in mixed
batches, under preemption and aborts. One engine, with prefix caching on: its windows run the same
steps as without it and also leave snapshots and hit them (an engine with it off, the same checks
again, cost a minute of compiling in each of make test's passes; the speculative server test runs
with it off). Drafts come from a scripted speculator: an oracle that proposes the target's own
greedy continuation (nearly every draft accepted) or random tokens (nearly none); either way a
window accepts exactly the drafts that match the tokens the engine emits."""

import numpy as np
import pytest

from serve.dspark import speculation
from serve.dspark.speculator import ScriptedSpeculator
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams
from tests.serve.test_engine import (assert_pool_full, check_outputs, generate, model, referee,  # noqa: F401
                                     reference_greedy, run_all, workload)

K = 7


class Oracle:
    """The continuation each prompt gets from the reference decoder, or random tokens."""

    def __init__(self, model):  # noqa: F811
        self.model = model
        self.references: dict[tuple, list[int]] = {}
        self.random = False
        self.rng = np.random.default_rng(0)

    def reference(self, prompt, max_tokens):
        key = tuple(prompt)
        if len(self.references.get(key, ())) < max_tokens:
            self.references[key] = reference_greedy(self.model, prompt, max_tokens)
        return self.references[key][:max_tokens]

    def __call__(self, request):
        if self.random:
            return self.rng.integers(0, self.model.config.vocab_size, K).tolist()
        return self.references[tuple(request.prompt)][len(request.output):]


@pytest.fixture(scope="module")
def oracle(model):  # noqa: F811
    return Oracle(model)


@pytest.fixture(scope="module")
def engine(model, oracle):  # noqa: F811
    engine = Engine(model, EngineOptions(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=40,
                                         max_prefill_chunk=16, max_prefill_rows=2, block_size=4, num_gpu_blocks=60,
                                         enable_prefix_caching=True),
                    speculator=ScriptedSpeculator(K, oracle))
    return engine  # no warmup: the steps compile for the shapes these tests use, and nothing more


@pytest.fixture
def windows(monkeypatch):
    """(request id, output length, drafts) of every window the engine verifies."""
    seen = []
    verify_step = speculation.verify_step

    def recording(engine, requests):
        seen.extend((r.id, len(r.output), list(r.drafts)) for r in requests)
        return verify_step(engine, requests)

    monkeypatch.setattr(speculation, "verify_step", recording)
    return seen


def check(engine, oracle, referee, prompts, max_tokens):  # noqa: F811
    for p, n in zip(prompts, max_tokens):
        oracle.reference(p, n)
    outputs = generate(engine, prompts, max_tokens)
    assert [len(o.token_ids) for o in outputs] == max_tokens
    check_outputs(referee, prompts, outputs)
    assert_pool_full(engine)
    return outputs


def accepted_drafts(windows, outputs):
    """What each window must accept: its drafts up to the first that differs from the token emitted
    there (greedy verification), per window."""
    emitted = {o.request_id: o.token_ids for o in outputs}
    accepted = []
    for request_id, done, drafts in windows:
        n = 0
        while n < len(drafts) and drafts[n] == emitted[request_id][done + n]:
            n += 1
        accepted.append(n)
    return accepted


def test_oracle_drafts_are_all_accepted_and_change_nothing(engine, oracle, referee, windows):  # noqa: F811
    oracle.random = False
    before = engine.stats()
    prompts, max_tokens = workload(3, 6, max_tokens=(9, 30))
    outputs = check(engine, oracle, referee, prompts, max_tokens)
    stats = engine.stats()
    drafted = stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    want = accepted_drafts(windows, outputs)
    assert drafted == sum(len(d) for _, _, d in windows) > 0 and accepted == sum(want)
    # the oracle's drafts are the reference's own tokens: they miss only where the engine's path and
    # the reference's part (a near-tie), a few tokens in the whole run
    assert accepted >= 0.9 * drafted
    full_windows = stats["spec_accepted_per_position"][K - 1] - before["spec_accepted_per_position"][K - 1]
    assert full_windows == sum(n == K for n in want) > 0  # 7 of 7 accepted


def test_random_drafts_are_rejected_and_change_nothing(engine, oracle, referee, windows):  # noqa: F811
    oracle.random = True
    before = engine.stats()
    prompts, max_tokens = workload(4, 6, max_tokens=(9, 20))
    outputs = check(engine, oracle, referee, prompts, max_tokens)
    stats = engine.stats()
    drafted = stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert drafted == sum(len(d) for _, _, d in windows) > 50
    assert accepted == sum(accepted_drafts(windows, outputs)) and accepted / drafted < 0.1


def test_preemption_and_aborts_with_speculation(engine, oracle, referee):  # noqa: F811
    oracle.random = False
    prompts, max_tokens = workload(5, 6, lengths=(20, 30), max_tokens=(60, 66))
    before = engine.scheduler.num_preemptions
    check(engine, oracle, referee, prompts, max_tokens)
    assert engine.scheduler.num_preemptions > before
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p in prompts[:3]]
    engine.step()
    engine.step()
    for request_id in ids:
        engine.abort(request_id)
    assert not engine.has_unfinished()
    assert_pool_full(engine)


def test_stop_token_inside_a_window_ends_the_output_there(engine, oracle, referee):  # noqa: F811
    oracle.random = False
    # a prompt whose first six greedy tokens no path within fp32's tolerance changes (no near-tie,
    # router or logit, up to there): the engine must emit exactly them, and stop at the stop token
    for prompt in workload(6, 20, lengths=(10, 11))[0]:
        reference = oracle.reference(prompt, 20)
        if referee.stable_prefix(prompt, reference) >= 6:
            break
    else:
        raise AssertionError("no prompt with six stable greedy tokens among 20")
    stop = reference[5]
    first = reference.index(stop)
    request_id = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                           stop_token_ids=[stop]))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    assert outputs[request_id].token_ids == reference[:first + 1]
    assert outputs[request_id].finish_reason == "stop"
    assert_pool_full(engine)


def test_windows_leave_a_snapshot_at_every_page_boundary_they_pass(engine, oracle, referee):  # noqa: F811
    """As plain decoding does (one snapshot per page boundary reached, Scheduler.register): 8-token
    windows over 4-token pages pass two boundaries each, and a later prompt resumes from the deepest."""
    oracle.random = False
    engine.reset_prefix_cache()
    prompt = list(range(3, 12))  # 9 tokens: the prompt's snapshot at 8, then windows from 9 to 17 to 25
    oracle.reference(prompt, 20)
    output = generate(engine, [prompt], [20])
    check_outputs(referee, [prompt], output)
    output = output[0].token_ids
    cache, page = engine.prefix_cache, engine.layout.page_size
    tokens = prompt + output
    # The pages the request cached while it ran: all but the last, filled by the step that finished it.
    hashes = cache.chain(tokens, 0, (len(tokens) - 1) // page - 1)
    snapshots = [i + 1 for i, h in enumerate(hashes) if cache.entries[h].snapshot is not None]
    assert [b * page for b in snapshots] == list(range(8, len(tokens) - 1, page))  # 8, 12, ..., 24
    # A prompt continuing the output resumes at the deepest boundary: only its tail is computed.
    follow = tokens[:len(tokens) - 1] + [5, 6]
    oracle.reference(follow, 3)
    hit_before = cache.hit_tokens
    check_outputs(referee, [follow], generate(engine, [follow], [3]))
    assert cache.hit_tokens - hit_before == snapshots[-1] * page
    assert_pool_full(engine)


@pytest.mark.isa_invariant
def test_structured_outputs_with_speculation(model, tmp_path):  # noqa: F811
    """A constrained request under speculation: each window ends before the first draft its grammar
    rejects, every window position samples under the grammar's mask after the drafts before it (a
    mask one position off would let the greedy pick break the grammar: the request would end with
    "error"), and drafts the grammar takes are accepted. Drafts are the unconstrained greedy
    continuation (mostly rejected by the grammar) or the constrained output itself (an oracle)."""
    import re

    from convert import synth
    from k3jax.presets import PRESETS
    from serve.llm import load_tokenizer
    from serve.structured import StructuredOutputsParams

    synth.write_tokenizer(tmp_path, model.config)
    tokenizer = load_tokenizer(str(tmp_path))
    assert model.config.vocab_size == PRESETS["k3-tiny"]["text_config"]["vocab_size"]
    pattern = "[a-h]{6}(,[0-9]{2}){3}"
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern))
    options = EngineOptions(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=40, max_prefill_chunk=16,
                            max_prefill_rows=2, block_size=4, num_gpu_blocks=60)
    prompt = [5, 17, 42, 99, 3]
    plain = Engine(model, options, tokenizer=tokenizer).generate([prompt], [params])[0]
    assert re.fullmatch(pattern, plain.text) and plain.finish_reason == "stop"
    free = reference_greedy(model, prompt, 20)
    shape = "a" * 6 + ",00" * 3  # the pattern's one string shape: a letter a-h, a comma or a digit

    def fits(tokens: list[int]) -> bool:
        """Whether `tokens` (the output so far and a window's drafts) can still become a match."""
        text = bytes(t for t in tokens if t < 256).decode()
        ends = [i for i, t in enumerate(tokens) if t >= 256]
        return len(text) <= len(shape) and all(
            c in "abcdefgh" if k == "a" else c == k if k == "," else c.isdigit() for c, k in zip(text, shape)) \
            and all(i == len(tokens) - 1 and len(text) == len(shape) and t in tokenizer.eos_token_ids
                    for i, t in ((i, tokens[i]) for i in ends))

    for drafts_of, oracle_drafts in ((lambda r: free[len(r.output):], False),
                                     (lambda r: plain.token_ids[len(r.output):], True)):
        engine = Engine(model, options, tokenizer=tokenizer, speculator=ScriptedSpeculator(K, drafts_of))
        windows, verify = [], engine.runner.verify

        def recording(rows, *args, **kwargs):
            windows.extend(list(engine.requests.values())[0].output + list(tokens[1:]) for tokens, *_ in rows)
            return verify(rows, *args, **kwargs)

        engine.runner.verify = recording
        out = engine.generate([prompt], [params])[0]
        assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", out
        assert windows and all(fits(w) for w in windows)  # every verified draft fits the grammar
        stats = engine.stats()
        if oracle_drafts:  # valid drafts go through whole: most tokens come from accepted drafts
            assert stats["spec_num_accepted_tokens"] >= len(out.token_ids) // 2, stats
        assert_pool_full(engine)
