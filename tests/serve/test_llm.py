"""The offline API on the embedded default model (the trained k3-tiny shipped in k3jax/weights, with
its byte-level tokenizer), and the cache options it exposes: text in, text out, stop strings, FP8 pages."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from benchmarks.engine_fp8_agreement import LAYOUT, MAX_MODEL_LEN, greedy_picks, trained_bf16_model
from convert import synth
from serve.engine import Engine
from serve.llm import default_model_dir, load_tokenizer
from serve.runner import Runner
from tests.k3jax.tiny_configs import k3_tiny_dict


@pytest.fixture(scope="module")
def llm():
    return k3jax.LLM(dtype="float32", max_model_len=64, max_num_seqs=4, max_prefill_chunk=32, block_size=8)


def test_default_model_is_the_shipped_one_and_serves_text(llm):
    path = default_model_dir()  # the trained k3-tiny in the package, with its training report
    assert os.path.isfile(os.path.join(path, "training.json")) and llm.engine.tokenizer is not None
    out = llm.generate(["hello world", [104, 105]], k3jax.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    tokenizer = llm.engine.tokenizer
    assert out[0].prompt_token_ids == tokenizer.encode("hello world")
    for o in out:
        assert len(o.token_ids) == 6 and o.finish_reason == "length"
        assert o.text == tokenizer.decode(o.token_ids, skip_special_tokens=True)
    # no prefix cache, no speculation: nothing else to count but the vision encoder's cache (the shipped
    # k3-tiny has a tower), idle here; every prompt token was computed, and the steps run ahead (async
    # scheduling) ran
    stats = llm.stats()
    assert set(stats) == {"num_preemptions", "num_steps_ahead", "num_computed_prompt_tokens", "encoder_cache_hits",
                          "encoder_runs"}
    assert stats["encoder_cache_hits"] == stats["encoder_runs"] == 0
    assert stats["num_computed_prompt_tokens"] == sum(len(o.prompt_token_ids) for o in out)
    assert stats["num_steps_ahead"] > 0


def test_stop_string_cuts_the_text_where_it_starts(llm):
    greedy = k3jax.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, skip_special_tokens=True)
    full = llm.generate("abc", greedy)[0]
    text = full.text
    assert len(text) >= 4
    stop = text[2:4]
    stopped = llm.generate("abc", k3jax.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[:text.find(stop)]
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)]


def test_text_prompt_without_a_tokenizer_is_refused(tmp_path):
    synth.write_checkpoint(tmp_path, k3_tiny_dict(), seed=1)
    (tmp_path / "tiktoken.model").unlink()
    model = k3jax.from_pretrained(tmp_path, dtype="float32")
    engine = Engine(model, tokenizer=load_tokenizer(str(tmp_path)))
    with pytest.raises(ValueError, match="no tokenizer files: send token ids"):
        engine.add_request("hi")


def test_fp8_pages_agree_with_bf16_pages_on_95_percent_of_a_trained_models_tokens():
    """A 256-token greedy run with bf16 pages is fed token by token to fp8 E4M3 pages (scale 1) and
    the argmaxes compared at every position (benchmarks/engine_fp8_agreement.py; free-running runs
    part for good at their first flip, so they would not measure the cache).

    On a model with structure: the trained fixture (k3-tiny with dense MLPs trained on this
    repository's sources). Random weights give flat logits that any rounding flips (even the fp32
    model agrees with the bf16 one on only 36-46% of positions there; fp8 pages 75-84%)."""
    model, prompt = trained_bf16_model()
    bf16 = Runner(model, LAYOUT, max_model_len=MAX_MODEL_LEN)
    fp8 = Runner(model, LAYOUT, max_model_len=MAX_MODEL_LEN, kv_cache_dtype=jnp.float8_e4m3fn)
    reference, _ = greedy_picks(bf16, prompt, 256)
    picks, _ = greedy_picks(fp8, prompt, 256, feed=list(reference))
    assert len(set(reference.tolist())) > 10  # a varied continuation, not one token repeated
    assert np.mean(picks == reference) >= 0.95
