"""A failing request fails alone (issue 21): a step that raises is rerun without its culprit, which
finishes with finish_reason "error" while the others complete; requests a step could not run are
refused at admission; outputs as deltas join to the whole outputs; and a request's stop-token set
changes no compiled shape (the random k3-tiny in fp32, two running sequences: few step shapes)."""

import pytest

from k3jax.config import K3Config
from k3jax.model import K3Model
from serve import sampling
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams

VOCAB = 512


@pytest.fixture(scope="module")
def engine():
    model = K3Model.random(K3Config.from_preset("k3-tiny"), dtype="float32", seed=0)
    return Engine(model, EngineOptions(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16,
                                       max_prefill_chunk=16, max_prefill_rows=1))


def run(engine, requests, deltas=False) -> dict:
    """request id -> [finish reason, tokens, number of outputs], stepping until all are done."""
    for request_id, prompt, params in requests:
        engine.add_request(prompt, params, request_id)
    done = {request_id: [None, [], 0] for request_id, _, _ in requests}
    while engine.has_unfinished():
        for output in engine.step(deltas=deltas):
            record = done[output.request_id]
            record[0], record[2] = output.finish_reason, record[2] + 1
            record[1] = record[1] + output.token_ids if deltas else output.token_ids
    return done


def greedy(max_tokens, **kwargs):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_a_step_that_fails_for_one_request_finishes_it_alone(engine, monkeypatch):
    append = engine._append

    def failing(request, token):
        if request.id == "bad" and len(request.output) == 2:
            raise RuntimeError("a bug that only this request triggers")
        append(request, token)

    monkeypatch.setattr(engine, "_append", failing)
    done = run(engine, [("good", [1, 2, 3], greedy(8)), ("bad", [4, 5], greedy(8)), ("late", [6], greedy(4))])
    assert done["bad"][0] == "error" and len(done["bad"][1]) == 2
    assert (done["good"][0], len(done["good"][1])) == ("length", 8)  # preempted and recomputed: no token lost
    assert (done["late"][0], len(done["late"][1])) == ("length", 4)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.allocator.free_slots == engine.layout.num_slots - 1


def test_requests_a_step_could_not_run_are_refused_at_admission(engine):
    for prompt, params, field in [([], greedy(2), "prompt"), ([VOCAB], greedy(2), "prompt"),
                                  ([1], SamplingParams(top_k=VOCAB + 1), "top_k"),
                                  ([1], SamplingParams(top_k=2 ** 31), "top_k"),
                                  ([1], greedy(2, stop_token_ids=[VOCAB]), "stop_token_ids"),
                                  ([1], greedy(2, logit_bias={VOCAB: 1.0}), "logit_bias"),
                                  ([1] * 128, greedy(2), "prompt")]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_deltas_join_to_the_whole_output_and_stop_ids_change_no_shape(engine):
    whole = run(engine, [("whole", [7, 8, 9], greedy(6, logprobs=2))])
    compiles = sampling.sample._cache_size()
    stop_ids = [t for t in range(VOCAB) if t != whole["whole"][1][0]] * 6  # 3,066 ids, bans all but the first token
    delta = run(engine, [("delta", [7, 8, 9], greedy(6, logprobs=2, min_tokens=1, stop_token_ids=stop_ids))],
                deltas=True)
    assert sampling.sample._cache_size() == compiles  # the same sampler program, 3,000 stop ids or none
    # Both ran alone: the same programs on the same inputs, so the same greedy tokens until the
    # first that differs from the first token, a stop id; each step's delta held one new token.
    tokens = whole["whole"][1]
    stop_at = next((i for i, t in enumerate(tokens) if t != tokens[0]), None)
    assert delta["delta"][1] == tokens[:len(tokens) if stop_at is None else stop_at + 1]
    assert delta["delta"][0] == ("length" if stop_at is None else "stop")
    assert delta["delta"][2] == len(delta["delta"][1])


def test_a_paused_request_keeps_its_cache_and_waits_while_the_others_run(engine):
    engine.add_request([1, 2], greedy(6), "paused")
    engine.add_request([3, 4], greedy(3), "running")
    while not engine.requests["paused"].output:
        engine.step()
    engine.pause("paused")
    held = list(engine.requests["paused"].output)
    outputs = {}
    while "running" not in outputs or not outputs["running"].finished:
        outputs.update((o.request_id, o) for o in engine.step())
    assert engine.requests["paused"].output == held and engine.requests["paused"].pages
    engine.step()
    assert engine.idle  # nothing to run: the server's engine thread sleeps instead of spinning
    engine.pause("paused", False)
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    assert len(outputs["paused"].token_ids) == 6 and outputs["running"].finish_reason == "length"
