"""Speculative decoding in the engine (fp32, greedy): whatever the drafts, the tokens equal those of
each prompt run alone without speculation, with prefix caching off and on, in mixed batches, under
preemption and aborts. Drafts come from a scripted speculator: an oracle that proposes the target's
own greedy continuation (every draft accepted) or random tokens (nearly none)."""

import numpy as np
import pytest

from serve.dspark.speculator import ScriptedSpeculator
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams
from tests.serve.test_engine import assert_pool_full, model, reference_greedy, run_all, workload  # noqa: F401

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


@pytest.fixture(scope="module", params=[False, True], ids=["no-prefix-cache", "prefix-cache"])
def engine(model, oracle, request):  # noqa: F811
    engine = Engine(model, EngineOptions(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=40,
                                         max_prefill_chunk=16, max_prefill_rows=2, block_size=4, num_gpu_blocks=60,
                                         enable_prefix_caching=request.param),
                    speculator=ScriptedSpeculator(K, oracle))
    return engine  # no warmup: the steps compile for the shapes these tests use, and nothing more


def check(engine, oracle, prompts, max_tokens):
    want = [oracle.reference(p, n) for p, n in zip(prompts, max_tokens)]
    got = run_all(engine, prompts, max_tokens)
    for prompt, tokens, expected in zip(prompts, got, want):
        assert tokens == expected, f"prompt of {len(prompt)} tokens"
    assert_pool_full(engine)


def test_oracle_drafts_are_all_accepted_and_change_nothing(engine, oracle):
    oracle.random = False
    before = engine.stats()
    prompts, max_tokens = workload(3, 6, max_tokens=(9, 30))
    check(engine, oracle, prompts, max_tokens)
    stats = engine.stats()
    drafted = stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert drafted > 0 and accepted == drafted
    full_windows = stats["spec_accepted_per_position"][K - 1] - before["spec_accepted_per_position"][K - 1]
    assert full_windows > 0  # 7 of 7 accepted


def test_random_drafts_are_rejected_and_change_nothing(engine, oracle):
    oracle.random = True
    before = engine.stats()
    prompts, max_tokens = workload(4, 6, max_tokens=(9, 20))
    for p, n in zip(prompts, max_tokens):
        oracle.reference(p, n)
    check(engine, oracle, prompts, max_tokens)
    stats = engine.stats()
    drafted = stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert drafted > 50 and accepted / drafted < 0.1


def test_preemption_and_aborts_with_speculation(engine, oracle):
    oracle.random = False
    prompts, max_tokens = workload(5, 6, lengths=(20, 30), max_tokens=(60, 66))
    before = engine.scheduler.num_preemptions
    check(engine, oracle, prompts, max_tokens)
    assert engine.scheduler.num_preemptions > before
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p in prompts[:3]]
    engine.step()
    engine.step()
    for request_id in ids:
        engine.abort(request_id)
    assert not engine.has_unfinished()
    assert_pool_full(engine)


def test_stop_token_inside_a_window_ends_the_output_there(engine, oracle):
    oracle.random = False
    prompt = workload(6, 1, lengths=(10, 11))[0][0]
    reference = oracle.reference(prompt, 20)
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


@pytest.mark.parametrize("engine", [True], ids=["prefix-cache"], indirect=True)  # snapshots are the prefix cache's
def test_windows_leave_a_snapshot_at_every_page_boundary_they_pass(engine, oracle):
    """As plain decoding does (one snapshot per page boundary reached, Scheduler.register): 8-token
    windows over 4-token pages pass two boundaries each, and a later prompt resumes from the deepest."""
    oracle.random = False
    engine.reset_prefix_cache()
    prompt = list(range(3, 12))  # 9 tokens: the prompt's snapshot at 8, then windows from 9 to 17 to 25
    oracle.reference(prompt, 20)
    output = run_all(engine, [prompt], [20])[0]
    cache, page = engine.prefix_cache, engine.layout.page_size
    tokens = prompt + output
    # The pages the request cached while it ran: all but the last, filled by the step that finished it.
    hashes = cache.chain(tokens, 0, (len(tokens) - 1) // page - 1)
    snapshots = [i + 1 for i, h in enumerate(hashes) if cache.entries[h].snapshot is not None]
    assert [b * page for b in snapshots] == list(range(8, len(tokens) - 1, page))  # 8, 12, ..., 24
    # A prompt continuing the output resumes at the deepest boundary: only its tail is computed.
    follow = tokens[:len(tokens) - 1] + [5, 6]
    want = oracle.reference(follow, 3)
    hit_before = cache.hit_tokens
    assert run_all(engine, [follow], [3])[0] == want
    assert cache.hit_tokens - hit_before == snapshots[-1] * page
    assert_pool_full(engine)
