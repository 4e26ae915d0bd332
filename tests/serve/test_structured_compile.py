"""Grammars compile before their request reaches the engine (serve/structured.py `Grammars.compile`,
called by the HTTP server's submit in a worker thread): the engine thread's add_request then only
copies a compiled grammar, the copies keep their own states, and the cache of compiled grammars
is bounded. Counted by wrapping llguidance's compiler; no model runs."""

import asyncio
import threading
import types

import llguidance
import pytest

from k3jax.config import K3Config
from serve import api_common, structured
from serve.llm import default_model_dir, load_tokenizer
from serve.sampling import SamplingParams
from serve.structured import Grammars, StructuredOutputsParams

SPEC = {"json": {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
                 "additionalProperties": False}}


@pytest.fixture
def compiles(monkeypatch):
    """The threads llguidance compiled a grammar on, one entry per compile."""
    threads = []
    real = llguidance.LLMatcher

    def counted(*args, **kwargs):
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", counted)
    return threads


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_dir())


def grammars(tokenizer) -> Grammars:
    config = K3Config.from_pretrained(default_model_dir())
    return Grammars(tokenizer, config.vocab_size, tokenizer.eos_token_ids)


def test_add_copies_a_compiled_grammar_and_copies_keep_their_own_state(tokenizer, compiles):
    g = grammars(tokenizer)
    g.compile(StructuredOutputsParams(**SPEC))
    g.add("a", StructuredOutputsParams(**SPEC))  # an equal spec, as each choice of a request builds its own
    g.add("b", StructuredOutputsParams(**SPEC))
    assert len(compiles) == 1
    text = tokenizer.encode('{"a":"x"}')
    assert all(g.advance("a", t) for t in text)
    assert g.valid_drafts("b", text) == len(text) and g.advance("b", tokenizer.encode('{"a":"y"}')[0])
    assert not g.advance("a", text[0])  # "a" has closed its object: its state moved, "b"'s did not follow


def test_the_cache_is_bounded_and_a_missing_grammar_compiles_in_add(tokenizer, compiles, monkeypatch):
    monkeypatch.setattr(structured, "MAX_COMPILED", 2)
    g = grammars(tokenizer)
    specs = [StructuredOutputsParams(regex=f"[a-z]{{{n}}}") for n in (1, 2, 3)]
    for spec in specs:
        g.compile(spec)
    g.add("kept", specs[2])
    assert len(compiles) == 3
    g.add("dropped", specs[0])  # the least recently used left the cache: compiled again, in add
    assert len(compiles) == 4


def test_a_bad_grammar_fails_in_compile_naming_the_field(tokenizer):
    with pytest.raises(ValueError, match="^structured_outputs.grammar: "):
        grammars(tokenizer).compile(StructuredOutputsParams(grammar="root ::= ("))


def test_the_server_compiles_in_a_worker_thread_before_submitting(tokenizer, compiles):
    """api_common.submit against a stand-in engine whose submit adds the requests on the calling
    (event loop) thread, as the engine thread would: the compile ran elsewhere, once for n choices."""
    g = grammars(tokenizer)
    added = []

    class Engine:
        engine = types.SimpleNamespace(grammars=g)

        async def submit(self, requests):
            for i, (_, params) in enumerate(requests):
                g.add(f"r{i}", params.structured_outputs)
                added.append(threading.get_ident())

    requests = [([1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(**SPEC))) for _ in range(3)]
    asyncio.run(api_common.submit(Engine(), requests))
    assert len(compiles) == 1 and compiles[0] != added[0] and len(set(added)) == 1
