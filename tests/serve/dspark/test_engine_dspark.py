"""The engine with the DSpark draft of `python -m convert.synth --preset k3-tiny-dspark` (fp32).

The draft's pages are filled incrementally (prefill chunks, the accepted part of each verify window,
prefix-cache hits that skip tokens), so the drafts it proposes must equal those of a draft whose
context is injected in one go from a full forward of the target over the same tokens (under the
router choices the referee found for the request, wherever the draft's own margin exceeds fp32's
tolerance). Greedy outputs are the target's own greedy tokens (tests/agreement.py); sampled requests
are reproducible under a seed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert import synth
from k3jax.dspark import model as dd
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams
from tests import agreement
from tests.serve.test_engine import (CountCompiles, assert_pool_full, check_outputs, generate, model,  # noqa: F401
                                     referee, workload)

K = 4
MAX_LEN = 96
PAGE_SIZE = 4


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("draft")
    synth.main(["--preset", "k3-tiny-dspark", "--out", str(directory), "--seed", "1"])
    return str(directory)


def make_engine(model, draft_dir, **options):  # noqa: F811
    return Engine(model, EngineOptions(
        max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=40, max_prefill_chunk=16, max_prefill_rows=2,
        block_size=PAGE_SIZE, num_gpu_blocks=80, enable_prefix_caching=True,
        speculative_config={"method": "dspark", "model": draft_dir, "num_speculative_tokens": K}, **options))


def one_shot_drafts(model, spec, tokens, computed, num_tokens, flips=()):  # noqa: F811
    """The drafts after `tokens[computed]` and their logits [K, V] from fresh pages holding the context
    of tokens[:computed], tapped from one full forward of the target (its routers taking `flips`)."""
    padded = np.zeros((1, MAX_LEN), np.int32)
    padded[0, :computed] = tokens[:computed]
    drafts, logits = _one_shot(model.graphdef, spec.structure, spec.taps, spec.cfg, num_tokens, model.params,
                               spec.param_leaves, spec.head, jnp.asarray(padded), jnp.int32(computed),
                               jnp.int32(tokens[computed]), agreement.flip_table(flips))
    return np.asarray(drafts)[0].tolist(), np.asarray(logits)[0]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _one_shot(graphdef, draft_structure, taps, cfg, num_tokens, params, draft_params, head, padded, computed, bonus,
              flips):
    with agreement.following(flips):
        tapped = nnx.merge(graphdef, params).forward(padded, taps=taps).taps
    num_pages = MAX_LEN // PAGE_SIZE + 2
    table = jnp.arange(1, num_pages, dtype=jnp.int32)[None, :]
    pages = dd.init_draft_pages(cfg, num_pages, PAGE_SIZE, jnp.float32)
    draft = draft_structure.merge(draft_params)
    valid = jnp.arange(MAX_LEN)[None, :] < computed
    pages = dd.inject_context(draft, pages, tapped, valid, jnp.zeros((1,), jnp.int32), table)
    drafts, logits, _ = dd.propose(draft, pages, bonus[None], computed[None], table, head,
                                   temperature=jnp.zeros((1,), jnp.float32),
                                   keys=jax.random.split(jax.random.key(0), 1), greedy_only=True, num_tokens=num_tokens)
    return drafts, logits


@pytest.fixture(scope="module")
def engine(model, draft_dir):  # noqa: F811
    return make_engine(model, draft_dir)


def test_incremental_draft_context_equals_one_shot_and_output_equals_plain_greedy(model, engine, referee):  # noqa: F811
    check_drafts_and_outputs(model, engine, referee)


def test_on_a_mesh_with_data_groups_the_draft_follows_each_row(model, draft_dir, referee, monkeypatch):  # noqa: F811
    """DP attention (2x2: each data group's requests in its own rows and pool blocks): the verify
    windows' logits and taps come back in request order and the KDA commits land in each row's own
    block, and the draft (its pages whole on every device) reads each prefill row's taps where the
    step placed it: the same checks as on one device, with windows of both groups in one step, each
    request's pages and slot in its own group's block."""
    from k3jax.model import K3Model
    from serve.dspark import speculation
    from sharding.mesh import make_mesh

    sharded = K3Model(model.config, model.graphdef, model.params, make_mesh("2x2"))
    # each group keeps the snapshots one device's engine keeps (the windows take one at every page boundary)
    engine = make_engine(sharded, draft_dir, num_snapshot_slots=8)
    assert engine.layout.groups == 2
    verify_step, groups = speculation.verify_step, []

    def recording(engine, requests):
        allocator = engine.allocator
        for r in requests:
            assert {allocator.group_of_page(p) for p in r.pages} == {r.group} == {allocator.group_of_slot(r.slot)}
        groups.append(sorted(r.group for r in requests))
        return verify_step(engine, requests)

    monkeypatch.setattr(speculation, "verify_step", recording)
    check_drafts_and_outputs(model, engine, referee)
    assert [0, 0, 1, 1] in groups or [0, 1, 1] in groups or [0, 0, 1] in groups


def check_drafts_and_outputs(model, engine, referee):  # noqa: F811
    spec = engine.speculator
    proposals = []
    propose = spec.propose

    def recording(requests, num_rows):
        drafts, logits = propose(requests, num_rows)
        proposals.extend((list(r.tokens), r.computed, d.tolist()) for r, d in zip(requests, drafts))
        return drafts, logits

    spec.propose = recording
    shared = workload(7, 1, lengths=(30, 31))[0][0]
    prompts, max_tokens = workload(8, 5, lengths=(5, 40), max_tokens=(8, 24))
    # the first request leaves `shared` (its KDA snapshot at the last page boundary) in the prefix cache
    prompts = [shared] + [shared + p[:8] for p in prompts[1:3]] + prompts[3:]
    outputs = generate(engine, prompts[:1], max_tokens[:1]) + generate(engine, prompts[1:], max_tokens[1:])
    report = check_outputs(referee, prompts, outputs)
    assert engine.prefix_cache.hit_rate > 0
    assert engine.stats()["spec_num_draft_tokens"] > 0
    assert_pool_full(engine)

    # Each checked proposal against the one-shot draft, whose target forward takes the router flips
    # the referee found for that request; compared up to the one-shot draft's first near-tie (a
    # Markov draft's later tokens follow from the earlier ones).
    sequences = [p + o.token_ids for p, o in zip(prompts, outputs)]
    rng = np.random.default_rng(0)
    checked = skipped = 0
    for i in rng.choice(len(proposals), 6, replace=False):
        tokens, computed, drafts = proposals[i]
        request = next(r for r, seq in enumerate(sequences) if seq[:len(tokens)] == tokens)
        flips = report.certificates[request].run.flips
        want, logits = one_shot_drafts(model, spec, tokens, computed, K, flips)
        slack = 2 * referee.tol.logits * np.abs(logits).max()
        for j in range(K):
            top2 = np.sort(logits[j])[-2:]
            if top2[1] - top2[0] <= slack:
                skipped += K - j
                break
            assert drafts[j] == want[j], f"draft {j} at position {computed}: {drafts} against {want}"
            checked += 1
    assert checked >= 0.75 * (checked + skipped), (checked, skipped)


def test_sampled_requests_with_greedy_drafts_are_reproducible(model, engine, referee):  # noqa: F811
    """Sampled rows verify greedy drafts as point masses (the server test covers probabilistic drafts).
    The second run repeats the first on an empty prefix cache: the same steps, so the same numbers
    (a prefix-cache hit would resume from a snapshot, another numeric path)."""
    prompts, _ = workload(9, 3, lengths=(5, 30))

    def generate_all():
        ids = [engine.add_request(p, SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True))
               for i, p in enumerate(prompts)]
        greedy = engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                               logprobs=1))
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return [done[i].token_ids for i in ids], done[greedy]

    before = engine.stats()["spec_num_draft_tokens"]
    engine.reset_prefix_cache()
    first, greedy = generate_all()
    engine.reset_prefix_cache()
    second, _ = generate_all()
    assert first == second and all(len(t) == 12 for t in first)
    assert len({tuple(t) for t in first}) == len(first)
    check_outputs(referee, prompts[:1], [greedy])
    assert engine.stats()["spec_num_draft_tokens"] > before
    assert_pool_full(engine)


@pytest.mark.isa_invariant
def test_background_warmup_compiles_the_speculative_programs(model, draft_dir):  # noqa: F811
    """warmup(background=True) with a speculator (probabilistic drafting: the drafts' logits go to the
    rejection sampler too): the first shapes run, then a thread that runs no step compiles the rest,
    verify, accept, commit and the draft's calls included; once it is done, greedy and sampled requests
    compile nothing. (Options unlike the module engine's: none of these shapes is compiled yet.
    test_engine.py's background test covers serving while the thread compiles.)"""
    engine = Engine(model, EngineOptions(
        max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, max_prefill_chunk=8, max_prefill_rows=2,
        block_size=PAGE_SIZE, num_gpu_blocks=48, enable_prefix_caching=True,
        speculative_config={"method": "dspark", "model": draft_dir, "num_speculative_tokens": K - 1,
                            "draft_sample_method": "probabilistic"}))
    progress = []
    thread = engine.warmup(background=True, log=lambda done, total: progress.append((done, total)))
    assert thread is not None and progress == [(1, 4), (2, 4)]  # decode rows 1, 2; prefill rows 1, 2 of 8 tokens
    thread.join()
    assert progress[-1] == (4, 4)
    with CountCompiles() as compiles:
        prompts, max_tokens = workload(11, 4, lengths=(1, 30), max_tokens=(4, 8))
        params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=n, logprobs=2 if i % 3 else None,
                                 repetition_penalty=1.2 if i == 2 else 1.0) for i, n in enumerate(max_tokens)]
        for p, sp in zip(prompts, params):
            engine.add_request(p, sp)
        while engine.has_unfinished():
            engine.step()
    assert compiles.count == 0 and engine.stats()["spec_num_draft_tokens"] > 0
    assert_pool_full(engine)
