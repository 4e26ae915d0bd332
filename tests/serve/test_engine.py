"""The engine against a reference decoder that knows nothing of pages, slots or scheduling (fp32,
greedy): the full causal forward of each request's own tokens (teacher-forced), through
tests/agreement.py. The engine's steps add in other orders than the reference (chunks, batches,
decode steps, prefix-cache resumes), so its tokens must be the reference's argmax wherever the
margin exceeds fp32's tolerance, under the router choices the reference finds for it, and its
logprobs the reference's log-softmax."""

import jax
import numpy as np
import pytest

from k3jax.config import K3Config
from k3jax.model import K3Model
from k3jax.serve import engine_options, parse_args
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams
from serve.sequence_parallel_prefill import bucket_length
from sharding.mesh import make_mesh
from tests.agreement import Referee

PAD = 96  # every reference prefill is padded to this length: one compiled shape


@pytest.fixture(scope="module")
def model():
    return K3Model.random(K3Config.from_preset("k3-tiny"), dtype="float32", seed=0)


@pytest.fixture(scope="module")
def referee(model):
    return Referee(model)


def reference_greedy(model, prompt, max_tokens):
    """The greedy continuation through prefill + decode steps: drafts for the speculative tests'
    oracle (a path of its own: compare engines with the referee, not with this)."""
    tokens = np.zeros((1, PAD), np.int32)
    tokens[0, :len(prompt)] = prompt
    logits, cache = model.prefill(tokens, [len(prompt)], max_len=PAD + 32)
    out = [int(np.argmax(logits[0, len(prompt) - 1]))]
    while len(out) < max_tokens:
        step, cache = model.decode([out[-1]], cache)
        out.append(int(np.argmax(step[0])))
    return out


def workload(seed, count, lengths=(1, 70), max_tokens=(4, 12)):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 512, rng.integers(*lengths)).tolist() for _ in range(count)]
    return prompts, rng.integers(*max_tokens, count).tolist()


def generate(engine, prompts, max_tokens, logprobs=1):
    """Greedy outputs (with logprobs entries: the chosen token's and `logprobs` alternatives)."""
    return engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
                                     for n in max_tokens])


def run_all(engine, prompts, max_tokens):
    return [out.token_ids for out in generate(engine, prompts, max_tokens, logprobs=None)]


def check_outputs(referee, prompts, outputs):
    """Every output's tokens and logprobs against the reference (tests/agreement.py)."""
    return referee.check_all(prompts, [o.token_ids for o in outputs], [o.logprobs for o in outputs])


def assert_pool_full(engine):
    engine.reset_prefix_cache()  # cached pages and snapshots nobody uses go back too
    layout = engine.layout
    assert engine.allocator.free_pages == layout.num_pages - layout.groups
    assert engine.allocator.free_slots == layout.num_slots - layout.groups


@pytest.fixture(scope="module", params=[False, True], ids=["no-prefix-cache", "prefix-cache"])
def engine(model, request):
    """One engine per mode for the tests (its compiled steps are reused): pages of 4 tokens, prefill
    chunks of at most 16 (long prompts span several steps), and 60 pages, fewer than 4 long requests
    need. Every test runs with prefix caching off and on: on must give the same tokens."""
    engine = Engine(model, EngineOptions(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=24,
                                         max_prefill_chunk=16, max_prefill_rows=2, block_size=4, num_gpu_blocks=60,
                                         enable_prefix_caching=request.param))
    engine.warmup()
    return engine


def test_concurrent_chunked_requests_match_each_run_alone(referee, engine):
    prompts, max_tokens = workload(0, 10)
    outputs = generate(engine, prompts, max_tokens)
    assert [len(o.token_ids) for o in outputs] == max_tokens
    check_outputs(referee, prompts, outputs)
    assert_pool_full(engine)


def test_preemption_when_pages_run_out_keeps_outputs(referee, engine):
    prompts, max_tokens = workload(1, 6, lengths=(40, 70), max_tokens=(10, 20))
    before = engine.scheduler.num_preemptions
    outputs = generate(engine, prompts, max_tokens)
    assert engine.scheduler.num_preemptions > before
    check_outputs(referee, prompts, outputs)
    assert_pool_full(engine)


@pytest.mark.isa_invariant
def test_random_workload_with_aborts_returns_every_page_and_slot(engine):
    rng = np.random.default_rng(2)
    live, finished, aborted = [], set(), 0

    def step():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
                live.remove(out.request_id)

    for i in range(200):
        prompt = rng.integers(0, 512, rng.integers(1, 40)).tolist()
        live.append(engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 8)),
                                                              ignore_eos=True)))
        if rng.random() < 0.3:  # cancel a random live request, waiting or running
            engine.abort(live.pop(int(rng.integers(len(live)))))
            aborted += 1
        if i % 4 == 0:
            step()
    while engine.has_unfinished():
        step()
    assert len(finished) + aborted == 200 and aborted > 30 and not live and not engine.requests
    assert_pool_full(engine)


class CountCompiles:
    """Counts XLA compilations while in the `with` block, a program loaded from the on-disk cache
    (tests/conftest.py) included: either way the program was not compiled yet in this process."""

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._compiled)
        jax.monitoring.register_event_listener(self._loaded)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._compiled)
        jax.monitoring.unregister_event_listener(self._loaded)

    def _compiled(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def _loaded(self, event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            self.count += 1


@pytest.mark.isa_invariant
def test_no_compilation_after_warmup(engine):
    with CountCompiles() as compiles:
        prompts, max_tokens = workload(3, 8, lengths=(1, 40))
        params = [SamplingParams(temperature=t, top_k=k, seed=i, max_tokens=n, logprobs=2 if i % 3 else None,
                                 repetition_penalty=1.2 if i % 6 in (0, 1) else 1.0)
                  for i, (t, k, n) in enumerate(zip([0.0, 0.7, 1.0, 0.0] * 2, [0, 5, 0, 3] * 2, max_tokens))]
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_unfinished():
            engine.step()
        steps_ahead = steady_batch(engine)
    assert ids and compiles.count == 0 and steps_ahead > 0


@pytest.mark.isa_invariant
def test_a_million_token_max_model_len_serves(model, referee):
    """`--max-model-len 1048576`: every step's page table spans 65536 pages of 16 tokens and the pool
    holds one full-length request (500 MiB of fp32 pages), and short requests give the reference's
    tokens and logprobs. Each step reads only the pages up to its rows' lengths (a chunk used to
    expand the table's whole width per head: seconds per chunk here); tests/pallas_kernels/
    test_mla_kernels.py holds the attention's memory to that."""
    engine = Engine(model, EngineOptions(max_model_len=1 << 20, max_num_seqs=1, max_num_batched_tokens=64,
                                         max_prefill_chunk=64, max_prefill_rows=1, block_size=16,
                                         num_gpu_blocks=(1 << 16) + 1))  # one row: two step shapes to compile
    assert engine.runner.page_table_width == 1 << 16
    prompts, max_tokens = workload(5, 2, lengths=(40, 64))  # one chunk each: the naive form (T > 32)
    check_outputs(referee, prompts, generate(engine, prompts, max_tokens))
    assert_pool_full(engine)


@pytest.mark.isa_invariant
def test_background_warmup_compiles_every_shape_while_the_engine_serves(model):
    """warmup(background=True) compiles the first request's shapes, then the rest on a thread that
    runs no step: requests served meanwhile get the reference tokens, and once the thread is done
    nothing compiles. (Options unlike the module engine's: none of these shapes is compiled yet.)"""
    engine = Engine(model, EngineOptions(max_model_len=96, max_num_seqs=2, max_num_batched_tokens=24,
                                         max_prefill_chunk=16, max_prefill_rows=2, block_size=8))
    progress = []
    thread = engine.warmup(background=True, log=lambda done, total: progress.append((done, total)))
    total = len(engine.decode_rows) + len(engine.prefill_rows) * len(engine.prefill_tokens)
    assert thread is not None and progress[-1] == (2, total)
    prompts, max_tokens = workload(7, 4)
    got = run_all(engine, prompts, max_tokens)
    thread.join()
    assert progress[-1] == (total, total)
    for prompt, n, tokens in zip(prompts, max_tokens, got):
        assert tokens == reference_greedy(model, prompt, n)
    with CountCompiles() as compiles:
        prompts, max_tokens = workload(8, 8, lengths=(1, 40))
        params = [SamplingParams(temperature=0.7 * (i % 2), max_tokens=n, logprobs=2 if i % 3 else None,
                                 repetition_penalty=1.2 if i % 4 == 0 else 1.0) for i, n in enumerate(max_tokens)]
        for p, sp in zip(prompts, params):
            engine.add_request(p, sp)
        while engine.has_unfinished():
            engine.step()
        steps_ahead = steady_batch(engine)
    assert compiles.count == 0 and steps_ahead > 0
    assert_pool_full(engine)


def steady_batch(engine) -> int:
    """Runs a full batch of plain greedy requests to the end; returns how many decode steps the engine
    ran ahead meanwhile (their tokens are the previous step's samples, still on the device: the
    warm-up must have compiled the step for those as well)."""
    before = engine.num_steps_ahead
    for prompt in workload(9, engine.options.max_num_seqs, lengths=(1, 10))[0]:
        engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return engine.num_steps_ahead - before


def test_dp_attention_keeps_each_request_in_its_data_group(model, referee):
    """DP attention, --mesh 8x2 (model x data 2; tests/serve/dspark/test_engine_dspark.py runs a
    speculative engine so on 2x2): rows split over data, heads over model, and
    the pools split over data too: each device holds half the pages and slots, each request's pages
    and slot lie in one data group's block, and both groups serve requests. Chunked prefills beside
    decodes, prefix-cache hits (a prompt that extends an earlier one joins the group that cached it)
    and preemptions inside a group give the one-device reference's tokens and logprobs, and nothing
    compiles after warm-up (the pools keep their shardings)."""
    sharded = K3Model(model.config, model.graphdef, model.params, make_mesh("8x2"))
    engine = Engine(sharded, EngineOptions(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=24,
                                           max_prefill_chunk=16, max_prefill_rows=2, block_size=4,
                                           num_gpu_blocks=26, enable_prefix_caching=True))
    layout, allocator = engine.layout, engine.allocator
    assert (layout.groups, layout.num_pages, layout.num_slots) == (2, 52, 2 * (2 + 2 + 1))
    assert engine.decode_rows == (2, 4) and engine.prefill_rows == (2,)
    for leaf in jax.tree.leaves(engine.runner.pools):
        if leaf.ndim:  # pages or slots first: each device holds its group's half
            assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // 2, leaf.shape
    engine.warmup()
    groups_used = set()

    def run(prompts, max_tokens):
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1))
               for p, n in zip(prompts, max_tokens)]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
            for r in engine.scheduler.running:
                assert {allocator.group_of_page(p) for p in r.pages} <= {r.group} == {allocator.group_of_slot(r.slot)}
                groups_used.add(r.group)
        return [done[i] for i in ids]

    prompts, max_tokens = workload(6, 8, lengths=(40, 70), max_tokens=(8, 16))
    with CountCompiles() as compiles:
        outputs = run(prompts, max_tokens)
        prompts.append(prompts[-1][:30])
        outputs += run(prompts[-1:], [4])
        prompts.append(prompts[-1] + [1, 2, 3])  # resumes from the snapshot the previous one left, in its group
        outputs += run(prompts[-1:], [4])
    assert compiles.count == 0
    assert groups_used == {0, 1}
    assert engine.scheduler.num_preemptions > 0
    assert outputs[-1].num_cached_tokens == 28
    check_outputs(referee, prompts, outputs)
    assert_pool_full(engine)


@pytest.mark.isa_invariant
def test_long_prompts_prefill_over_every_data_group(model, referee):
    """sequence_parallel_prefill_tokens on 2x2 (model x data 2): a fresh prompt of 48 tokens or more is
    prefilled by all four devices, its tokens split over data, and its cache written into its own
    group's pages and slot (the engine then computes only its last token); a shorter prompt, and one
    whose prefix the cache holds, prefill in chunks in their group as before. Every output has the
    one-device reference's tokens and logprobs."""
    sharded = K3Model(model.config, model.graphdef, model.params, make_mesh("2x2"))
    engine = Engine(sharded, EngineOptions(max_model_len=96, max_num_seqs=2, max_num_batched_tokens=32,
                                           max_prefill_chunk=16, max_prefill_rows=2, block_size=4,
                                           enable_prefix_caching=True, sequence_parallel_prefill_tokens=48))
    # one request a group at a time (two rows): few step shapes; the long prompts' 49-63 cached tokens
    # make one prefill program (64 tokens)
    prompts, max_tokens = workload(8, 2, lengths=(50, 65), max_tokens=(4, 8))
    prompts.insert(1, prompts[0][:20])  # short: chunked
    prompts.append(prompts[0] + [5, 6, 7])  # extends a cached prompt: a prefix hit, chunked from there
    max_tokens += [5, 5]
    outputs = generate(engine, prompts[:3], max_tokens[:3]) + generate(engine, prompts[3:], max_tokens[3:])
    # one computed prompt token for each of the 2 long prompts, all 20 of the short one, the tail of the hit
    hit = outputs[3].num_cached_tokens
    assert hit > 0 and engine.stats()["num_computed_prompt_tokens"] == 2 + 20 + len(prompts[3]) - hit
    check_outputs(referee, prompts, outputs)
    assert_pool_full(engine)


@pytest.mark.isa_invariant
def test_sequence_parallel_prefill_needs_data_groups(model):
    assert engine_options(parse_args(["--sequence-parallel-prefill-tokens", "65536"])).sequence_parallel_prefill_tokens \
        == 65536
    with pytest.raises(ValueError, match="sequence_parallel_prefill_tokens: needs a mesh with data > 1"):
        Engine(model, EngineOptions(sequence_parallel_prefill_tokens=64))  # one device
    with pytest.raises(ValueError, match="sequence_parallel_prefill_tokens must be at least 2"):
        EngineOptions(sequence_parallel_prefill_tokens=1)
    # prefilled at a power of two, in whole pages, and long enough for a conv window (3) in each shard
    assert [bucket_length(n, 16, 2, 4) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert bucket_length(5, 4, 8, 4) == 24 and bucket_length(5, 16, 8, 4) == 32


def test_seeded_sampling_does_not_depend_on_the_batch(referee, engine):
    """A seeded request draws the same tokens alone and in another row beside other requests: each
    run's tokens are the draws serve/sampling.py's key for (seed, step) makes from the reference
    logits, wherever fp32's tolerance cannot change the draw (tests/agreement.py)."""
    def sample(prompts, seeds):
        params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=8, ignore_eos=True, logprobs=1)
                  for s in seeds]
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        for prompt, sp, i in zip(prompts, params, ids):
            certificate = referee.check_sampled(prompt, done[i].token_ids, sp, done[i].logprobs, what=f"seed {sp.seed}")
            assert certificate.checked >= 6, certificate  # of 8 draws
        return [done[i].token_ids for i in ids]

    prompts, _ = workload(4, 4, lengths=(3, 30))
    alone = sample(prompts[:1], [7])[0]
    batched = sample(prompts[1:] + prompts[:1], [11, 3, 5, 7])[-1]  # another row, other neighbours
    assert len(alone) == len(batched) == 8
    assert sample(prompts[:1], [8])[0] != alone


def test_logprobs_are_the_models_log_softmax(referee, engine):
    prompt = [3, 14, 15, 92, 65]
    done = generate(engine, [prompt], [4], logprobs=3)[0]
    certificate = referee.check_greedy(prompt, done.token_ids, done.logprobs)  # values within fp32's tolerance
    assert certificate.checked >= 3
    run = certificate.run
    slack = 2 * referee.tol.logits * np.abs(run.logits).max()
    for i, (token, entry) in enumerate(zip(done.token_ids, done.logprobs)):
        row = run.logits[len(prompt) - 1 + i]
        third = np.sort(row)[-3]
        # the chosen token and the three most likely: one set (greedy), up to near-ties at the third
        assert token in entry and len(entry) == 3 and all(row[t] >= third - slack for t in entry), (i, entry)


def test_shared_prefixes_hit_the_cache_and_give_the_same_tokens(referee, engine):
    rng = np.random.default_rng(5)
    base = rng.integers(0, 512, 37).tolist()
    # the whole prompt again, a longer one, one sharing 30 tokens (7.5 pages), and one sharing none
    prompts = [base, base, base + [1, 2, 3, 4, 5], base[:30] + [9] * 9, base[:30] + [8] * 12, [4] + base]
    hits = engine.prefix_cache.hit_tokens if engine.prefix_cache else 0
    for prompt in prompts:  # one at a time, so each can hit what the previous ones left
        check_outputs(referee, [prompt], generate(engine, [prompt], [5]))
    if engine.prefix_cache is not None:
        # base again and base + 5 each resume from the snapshot after base's 9 full pages (36 tokens).
        # base[:30] + 9s and + 8s share 7.5 pages with base and 7.5 with each other: no snapshot ends
        # inside that, so they miss; [4] + base shares nothing.
        assert engine.prefix_cache.hit_tokens - hits == 36 + 36
    assert_pool_full(engine)


def test_bad_requests_are_refused_and_lose_nothing(referee, engine):
    with pytest.raises(ValueError, match="max_model_len=96"):
        engine.add_request(list(range(100)))
    with pytest.raises(ValueError, match=r"lie in \[0, 512\)"):
        engine.add_request([1, 600])
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("hello")
    with pytest.raises(ValueError, match=r"^stop_token_ids: token ids must lie in \[0, 512\)"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=[5, 10**9]))
    check_outputs(referee, [[5, 6, 7]], generate(engine, [[5, 6, 7]], [3]))
