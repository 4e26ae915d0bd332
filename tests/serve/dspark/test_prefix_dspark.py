"""Prefix caching keeps hitting with DSpark speculation on (issue 25): a request that shares a long
prefix with an earlier one resumes from the earlier one's cached pages and KDA snapshot, and its
tokens are still the target's own greedy tokens (tests/agreement.py: the full forward of its tokens).

A hybrid prefix is usable up to a KDA snapshot: each prompt's last page boundary, and under
speculation every page boundary a verify window reaches or passes (serve/dspark/speculation.py), so
a conversation resent with its output hits past the first prompt too."""

import numpy as np

from serve.sampling import SamplingParams
from tests.serve.dspark.test_engine_dspark import PAGE_SIZE, draft_dir, make_engine  # noqa: F401
from tests.serve.test_engine import model, referee  # noqa: F401

OUT = 8


def test_a_shared_prefix_hits_the_cache_with_speculation(model, referee, draft_dir):  # noqa: F811
    engine = make_engine(model, draft_dir)
    assert engine.speculator is not None and engine.prefix_cache is not None
    rng = np.random.default_rng(7)
    base = rng.integers(0, 512, 50).tolist()
    params = [SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)]
    first = engine.generate([base], params)[0]
    follow = base + rng.integers(0, 512, 6).tolist()
    resent = base + first.token_ids + rng.integers(0, 512, 6).tolist()
    outs = [first]
    for prompt in (follow, resent):  # one at a time: each can hit what the first left
        computed = engine.stats()["num_computed_prompt_tokens"]
        outs.append(engine.generate([prompt], params)[0])
        assert engine.stats()["num_computed_prompt_tokens"] - computed == len(prompt) - outs[-1].num_cached_tokens
    assert first.num_cached_tokens == 0
    assert outs[1].num_cached_tokens == (len(base) - 1) // PAGE_SIZE * PAGE_SIZE  # the first prompt's snapshot
    assert outs[2].num_cached_tokens > outs[1].num_cached_tokens  # a snapshot a verify window took
    assert engine.stats()["spec_num_drafts"] > 0
    referee.check_all([base, follow, resent], [o.token_ids for o in outs])
