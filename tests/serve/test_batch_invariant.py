"""`batch_invariant`: a request's tokens and logprobs do not depend on what else runs in its steps
(issue 21), in bf16, where other batch shapes otherwise round otherwise (the same greedy request
alone and among 15 others parted from its first token, logprobs about 0.5 apart).

Every step runs one program per kind (the largest row and token buckets), and a prompt's prefill
chunks depend on that prompt alone; a row's numbers then come out of the same operations whatever
the other rows hold, so the comparisons below are exact, not within a tolerance."""

import numpy as np
import pytest

from k3jax.config import K3Config
from k3jax.model import K3Model
from k3jax.serve import engine_options, parse_args
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams

PROMPT = list(range(3, 23))  # 20 tokens: chunks of 16 and 4
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=10, logprobs=2, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    model = K3Model.random(K3Config.from_preset("k3-tiny"), dtype="bfloat16", seed=0)
    return Engine(model, EngineOptions(max_model_len=64, max_num_seqs=16, max_num_batched_tokens=40,
                                       max_prefill_chunk=16, max_prefill_rows=4, block_size=8,
                                       batch_invariant=True))


def run(engine, requests):
    return engine.generate([prompt for prompt, _ in requests], [params for _, params in requests])


def test_a_request_is_the_same_alone_and_among_fifteen_others(engine):
    assert tuple(engine.decode_rows) == (16,) and len(engine.prefill_rows) == len(engine.prefill_tokens) == 1
    alone, alone_seeded = run(engine, [(PROMPT, GREEDY)])[0], run(engine, [(PROMPT, SEEDED)])[0]
    rng = np.random.default_rng(0)
    others = [(rng.integers(0, 512, int(n)).tolist(),
               SamplingParams(temperature=float(t), seed=i, max_tokens=int(m), ignore_eos=True))
              for i, (n, t, m) in enumerate(zip(rng.integers(3, 40, 7), [0, 1, 0.5, 0, 1, 0.7, 0],
                                                rng.integers(2, 14, 7)))]
    crowd = run(engine, others[:3] + [(PROMPT, GREEDY)] * 8 + [(PROMPT, SEEDED)] + others[3:])
    copies, seeded = crowd[3:11], crowd[11]
    for out in copies:
        assert out.token_ids == alone.token_ids and out.logprobs == alone.logprobs
    assert seeded.token_ids == alone_seeded.token_ids and seeded.logprobs == alone_seeded.logprobs
    assert len(set(alone.token_ids)) > 1 and alone_seeded.token_ids != alone.token_ids


def test_whole_chunks_wait_rather_than_shrink(engine, monkeypatch):
    """Prompts are chunked 16, 16, ..., rest whatever budget the decodes and the other chunks leave
    (without whole chunks, 40 tokens of budget split these prompts otherwise)."""
    chunks = {}
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        for request, n in plan.prefill:
            chunks.setdefault(request.id, []).append(n)
        return plan

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    lengths = (30, 20, 33, 17, 25, 9)
    outputs = run(engine, [(list(range(5, 5 + n)), SamplingParams(max_tokens=3, ignore_eos=True)) for n in lengths])
    for rid, n in zip([o.request_id for o in outputs], lengths):
        want, left = [], n
        while left > 1:  # a last lone prompt token runs in a decode row
            want.append(min(left, 16))
            left -= want[-1]
        assert chunks[rid] == want, (n, chunks[rid])


def test_refused_with_prefix_caching_or_speculation():
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineOptions(batch_invariant=True, enable_prefix_caching=True)


def test_the_server_flag_reaches_the_engine_and_a_bad_combination_is_a_usage_error(capsys):
    assert engine_options(parse_args(["--batch-invariant"])).batch_invariant
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--batch-invariant", "--enable-prefix-caching"])
    assert exit_info.value.code == 2 and "batch_invariant: not with prefix caching" in capsys.readouterr().err
