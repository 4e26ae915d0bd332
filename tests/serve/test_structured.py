"""Structured outputs (issue 23) on the random embedded k3-tiny, which never writes JSON by chance:
constrained outputs parse and validate for 24 random schemas, regex and choice hold, constrained and free
rows share batches without changing the free rows' tokens, with prefix caching on; through the
server, response_format and forced tool calls (official openai client).

One engine for the module, one server for the server tests.
"""

import json
import random
import re

import jsonschema
import pytest

from serve.chat.parsing import parse_output
from serve.llm import LLM
from serve.sampling import SamplingParams
from serve.structured import StructuredOutputsParams
from tests.serve.test_server import MODEL, TEXT_ONLY, start_server


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=768, max_num_seqs=8, enable_prefix_caching=True, block_size=16)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema whose every value is bounded (an unbounded string or array lets a random model run
    to max_tokens inside it: valid so far, but never finished)."""
    kinds = ["integer", "boolean", "enum", "string", "array"] + (["object"] if depth < 2 else [])
    properties = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "integer":
            low = rng.randint(-50, 50)
            prop = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "enum":
            prop = {"enum": rng.sample(["red", "green", "blue", 7, None, True, "x y"], rng.randint(1, 4))}
        elif kind == "string":
            prop = {"type": "string", "maxLength": rng.randint(0, 12)}
        elif kind == "array":
            prop = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": rng.randint(0, 4)}
        else:
            prop = random_schema(rng, depth + 1)
        properties[f"{kind[:3]}_{i}"] = prop
    return {"type": "object", "properties": properties, "required": sorted(properties),
            "additionalProperties": False}


def test_random_schemas_parse_and_validate(llm):
    """Three full batches of the module's engine (50 schemas took 59 s of make test; 24 still draw
    each kind of property 12 to 20 times, 14 of them nested objects)."""
    rng = random.Random(23)
    schemas = [random_schema(rng) for _ in range(24)]
    params = [SamplingParams(max_tokens=400, seed=i, structured_outputs=StructuredOutputsParams(json=schema))
              for i, schema in enumerate(schemas)]
    outputs = llm.generate(["Answer in JSON."] * len(schemas), params)
    for schema, output in zip(schemas, outputs):
        assert output.finish_reason == "stop", (schema, output.text)
        jsonschema.validate(json.loads(output.text), schema)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", output.text))  # no free whitespace


def test_regex_and_choice_hold_and_free_rows_keep_their_tokens(llm):
    free = [SamplingParams(max_tokens=24, seed=s, ignore_eos=True) for s in (1, 2)] + \
           [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)]
    alone = llm.generate(["The same prefix of a prompt, then one"] * 3, free)
    constrained = [SamplingParams(max_tokens=50, seed=3,
                                  structured_outputs=StructuredOutputsParams(regex="[a-z]{2,5}-[0-9]{3}")),
                   SamplingParams(max_tokens=50, temperature=0, structured_outputs=StructuredOutputsParams(
                       choice=["alpha", "beta", "gamma"]))]
    mixed = llm.generate(["The same prefix of a prompt, then one"] * 5, free + constrained)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert llm.stats()["prefix_cache_hit_rate"] > 0
    assert re.fullmatch("[a-z]{2,5}-[0-9]{3}", mixed[3].text) and mixed[3].finish_reason == "stop"
    assert mixed[4].text in ("alpha", "beta", "gamma")


def test_a_bad_grammar_is_refused_naming_the_field(llm):
    with pytest.raises(ValueError, match="^structured_outputs: "):
        llm.generate(["x"], [SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "objectx"},
                                                                                          strict=True))])
    with pytest.raises(ValueError, match="^structured_outputs: must set exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start_server(tmp_path_factory, "--max-model-len", "1024", "--max-num-seqs", "4",
                            "--enable-prefix-caching", *TEXT_ONLY)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                     "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"]}}}
INSTANT = {"chat_template_kwargs": {"thinking": False}}


def test_response_format_json_schema_through_the_server(server):
    client = server.client()
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 1000},
                                               "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "2+2?"}], max_tokens=200, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
            extra_body=INSTANT)
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    # thinking mode: the reasoning is free, the content after it constrained (a bias on <|close|>, id
    # 261 in k3-tiny, ends the reasoning soon; where the grammar bans it, the bias changes nothing)
    # Each seed's content validates; some seed's reasoning is not empty (one may close at once).
    reasonings = []
    for seed in range(5, 9):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "2+2?"}], max_tokens=300, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            logit_bias={"261": 5})
        message = reply.choices[0].message
        jsonschema.validate(json.loads(message.content), schema)
        reasonings.append(message.reasoning_content or getattr(message, "reasoning", None))
    assert any(reasonings)


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_tool_calls_always_parse(server, parallel):
    client = server.client()
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "search"}}] * 3):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], max_tokens=400,
            seed=seed, tools=[WEATHER, SEARCH], tool_choice=choice, parallel_tool_calls=parallel, extra_body=INSTANT)
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and calls, reply
        assert parallel or len(calls) == 1
        for call in calls:
            tool = {"get_weather": WEATHER, "search": SEARCH}[call.function.name]
            if isinstance(choice, dict):
                assert call.function.name == "search"
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_call_grammar_reads_back_with_the_parser(llm):
    """The grammar allows a call as the encoder writes it, and the parser reads it back."""
    grammars, tokenizer = llm.engine.grammars, llm.engine.tokenizer
    grammars.add("probe", StructuredOutputsParams(tools=[WEATHER["function"]], channel="response"))
    text = ('<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
            '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
            '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
            '<|close|>tools<|sep|><|close|>message<|sep|>')
    assert all(grammars.advance("probe", t) for t in tokenizer.encode(text, allow_special=True))
    grammars.drop("probe")
    parsed = parse_output(text, thinking=False, tools=[WEATHER])
    assert json.loads(parsed.tool_calls[0]["arguments"]) == {"city": "Paris", "days": 3}
