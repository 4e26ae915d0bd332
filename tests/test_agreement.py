"""tests/agreement.py, the referee the path-comparing tests rely on: its reference runs are the
model's forward, a router flip it applies is a real change of expert at that token only, it follows
a flip that explains a path and refuses one beyond the tolerance, it catches a wrong token, and its
sampled draws are the engine sampler's."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import K3Config
from k3jax.model import K3Model
from serve import sampling
from tests.agreement import FP32, Referee, tolerance

PROMPT = np.random.default_rng(11).integers(0, 512, 24).tolist()
# A router tolerance far above fp32's: every sequence has decisions this close, to flip on purpose.
LOOSE = dataclasses.replace(FP32, router=2.0 ** -6)


@pytest.fixture(scope="module")
def model():
    return K3Model.random(K3Config.from_preset("k3-tiny"), dtype="float32", seed=0)


@pytest.fixture(scope="module")
def referee(model):
    return Referee(model)


def greedy(referee, prompt, n, flips=()):
    """n greedy tokens by teacher-forced reference runs (under `flips`), and each one's logprobs entry."""
    tokens, entries = list(prompt), []
    for _ in range(n):
        row = referee.run(tokens, flips).logits[-1].astype(np.float64)
        logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
        tokens.append(int(np.argmax(row)))
        entries.append({tokens[-1]: float(logp[tokens[-1]])})
    return tokens[len(prompt):], entries


def test_tolerances_are_for_fp32_only():
    assert tolerance(jnp.float32) == FP32
    with pytest.raises(ValueError, match="compare bfloat16 paths by value"):
        tolerance(jnp.bfloat16)


def test_reference_runs_are_the_models_full_forward(model, referee):
    run = referee.run(PROMPT)
    want = model.logits(np.asarray([PROMPT]))[0]  # unpadded, through K3Model's own jitted forward
    assert run.logits.shape == want.shape and not run.flips and not run.applied
    assert np.abs(run.logits - want).max() <= FP32.logits * np.abs(want).max()
    assert run.router_margin.shape == (len(PROMPT),) and (run.router_margin > 0).all()
    assert np.isinf(run.group_margin).all()  # k3-tiny has one expert group


def test_a_flip_changes_that_tokens_expert_and_nothing_before_it(model):
    loose = Referee(model, tol=LOOSE)
    run = loose.run(PROMPT)
    position, a, b, margin = min(run.near_ties, key=lambda t: t[3])  # the tightest decision
    assert 0 <= margin < LOOSE.router and a != b
    flipped = loose.run(PROMPT, [(position, a, b)])
    assert flipped.applied == 1  # exactly one layer had (a, b) at ranks (k, k + 1) there
    scale = np.abs(run.logits).max()
    change = np.abs(flipped.logits - run.logits).max(-1)
    # before it only the MoE's grouping of tokens changed (rounding); at it a whole expert did
    assert change[:position].max(initial=0) <= FP32.logits * scale < change[position]
    # a flip whose pair is not at ranks (k, k + 1) of that token is not applied
    assert loose.run(PROMPT, [(position, b, a)]).applied == 0


def test_a_flip_that_explains_a_path_is_followed_and_one_beyond_the_tolerance_is_refused(model, referee):
    loose = Referee(model, tol=LOOSE)
    prompt = PROMPT[:12]
    # a path that flips a decision of the prompt's last token (its logprobs show it), one wider than
    # fp32's tolerance: the loose referee follows it, the fp32 one calls it a real difference
    position, a, b, margin = min((t for t in loose.run(prompt).near_ties
                                  if t[0] == len(prompt) - 1 and t[3] >= FP32.router), key=lambda t: t[3])
    output, logprobs = greedy(loose, prompt, 6, flips=[(position, a, b)])
    certificate = loose.check_greedy(prompt, output, logprobs)
    assert certificate.run.flips == ((position, a, b),) and certificate.checked + certificate.skipped == 6
    with pytest.raises(AssertionError, match="no flip of the .* router near-ties before it"):
        referee.check_greedy(prompt, output, logprobs)


def test_a_wrong_token_is_caught(referee):
    output, logprobs = greedy(referee, PROMPT, 8)
    certificate = referee.check_greedy(PROMPT, output, logprobs)
    assert certificate.checked >= 6 and not certificate.run.flips
    for i in (2, 5):  # the least likely token instead: no router flip makes that the best
        wrong = list(output)
        wrong[i] = int(np.argmin(certificate.run.logits[len(PROMPT) - 1 + i]))
        with pytest.raises(AssertionError, match=f"output {i} is {wrong[i]}"):
            referee.check_greedy(PROMPT, wrong)
    bad = [dict(e) for e in logprobs]
    token = output[3]
    bad[3][token] += 0.01  # 0.01 is ~40x fp32's tolerance on a logprob here
    with pytest.raises(AssertionError, match="logprob of"):
        referee.check_greedy(PROMPT, output, bad)


def test_a_token_inside_the_tolerance_is_counted_not_asserted(model):
    coarse = Referee(model, tol=dataclasses.replace(FP32, logits=2.0 ** -5))  # slack: 2^-4 of the largest logit
    tokens, seconds = list(PROMPT), 0
    for _ in range(12):  # a path that takes the runner-up wherever it is inside the slack
        run = coarse.run(tokens)
        row, top = run.logits[-1], np.argsort(run.logits[-1])
        inside = row[top[-1]] - row[top[-2]] <= 2 * coarse.tol.logits * np.abs(run.logits).max()
        tokens.append(int(top[-2] if inside else top[-1]))
        seconds += bool(inside)
    assert seconds  # k3-tiny's random logits: some runner-up within 2^-4 in 12 tokens
    certificate = coarse.check_greedy(PROMPT, tokens[len(PROMPT):])
    assert certificate.skipped >= seconds and certificate.checked + certificate.skipped == 12


def test_sampled_draws_are_the_engine_samplers(referee):
    params = sampling.SamplingParams(temperature=0.9, top_p=0.8, top_k=40, seed=5, max_tokens=8)
    tokens = list(PROMPT)
    for i in range(8):  # serve/sampling.py's own sampler on the reference logits, teacher-forced
        logits = referee.run(tokens).logits[-1:]
        batch = sampling.SamplingBatch.from_params([params], 1, num_generated=[i], request_ids=[0])
        tokens.append(int(sampling.sample(jnp.asarray(logits), batch, None, None).tokens[0]))
    output = tokens[len(PROMPT):]
    certificate = referee.check_sampled(PROMPT, output, params)
    assert certificate.checked >= 6
    with pytest.raises(AssertionError, match="where the reference allows"):  # another seed's draws differ
        referee.check_sampled(PROMPT, output, dataclasses.replace(params, seed=6))


def test_loglikelihoods_are_checked_against_the_reference_and_greedy_verdicts_where_certain(referee):
    context, continuation = PROMPT[:16], PROMPT[16:20]
    run = referee.run(PROMPT[:20])
    rows = run.logits[15:19].astype(np.float64)
    logp = rows - rows.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))  # NumPy log-softmax of the reference
    want = float(logp[np.arange(4), continuation].sum())
    greedy = bool(np.all(rows.argmax(-1) == continuation))
    certificate = referee.check_loglikelihood(context, continuation, want, greedy)
    assert certificate.checked + certificate.skipped == 4
    with pytest.raises(AssertionError, match="log-likelihood"):
        referee.check_loglikelihood(context, continuation, want + 0.05, greedy)  # ~10x the bound of 4 tokens
    argmax = rows[:1].argmax(-1).tolist()  # a one-token continuation that is the argmax, by a margin
    top2 = np.sort(rows[0])[-2:]
    assert top2[1] - top2[0] > 2 * FP32.logits * np.abs(run.logits).max()
    assert referee.check_loglikelihood(context, argmax, float(logp[0, argmax[0]]), True).checked == 1
    with pytest.raises(AssertionError, match="is_greedy False"):
        referee.check_loglikelihood(context, argmax, float(logp[0, argmax[0]]), False)
